"""Streaming quantization: a checkpoint quantized with one decoder block in memory at a time, resumable.

`reader` reads a safetensors checkpoint tensor by tensor, `skeleton` builds the model on the meta
device and fills one part of it at a time, `writer` writes the output's shards tensor by tensor
under a header written first, `partial` keeps the staging folder and its resume manifest,
`blocks` plugs all of it into the calibration schedule, and `quantize` runs the whole.
"""

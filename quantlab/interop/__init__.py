"""Checkpoints other libraries write, in quantlab's storage: compressed-tensors and GPTQ."""

"""NF4 with optional double quantization (QLoRA, arXiv 2305.14314).

At blocksize 64 with double quantization a weight costs 4 + 8/64 + 32/(64*256) ≈ 4.127 bits.
The 4-bit codes equal those of `bitsandbytes.functional.quantize_4bit(quant_type="nf4")`.
"""

import dataclasses

import torch

from quantlab.config import QuantlabConfig, check_group_size
from quantlab.formats import grouping, nf4, packing
from quantlab.nn import QuantizedLinear
from quantlab.nn.quantized_linear import StorageSpec

_BITS = 4


@dataclasses.dataclass(repr=False)
class NF4Config(QuantlabConfig):
    """NormalFloat-4 in blocks of `blocksize`; `double_quant` stores each block's absmax in 8 bits."""

    method = "nf4"

    blocksize: int = 64
    double_quant: bool = True

    def validate(self) -> None:
        check_group_size(self.method, "blocksize", self.blocksize, 16, 4096)


class NF4Linear(QuantizedLinear):
    config_class = NF4Config

    @property
    def format(self) -> str:
        return "nf4"

    @classmethod
    def storage_spec(cls, in_features: int, out_features: int, config: NF4Config) -> StorageSpec:
        blocks = grouping.num_groups(in_features, config.blocksize)
        spec: StorageSpec = {
            "weight": ((out_features, blocks, packing.packed_size(config.blocksize, _BITS)), torch.uint8)
        }
        if config.double_quant:
            absmax_blocks = -(-out_features * blocks // nf4.ABSMAX_BLOCKSIZE)
            spec["weight_absmax_codes"] = ((out_features, blocks), torch.uint8)
            spec["weight_absmax_scale"] = ((absmax_blocks,), torch.float32)
            spec["weight_absmax_offset"] = ((1,), torch.float32)
        else:
            spec["weight_absmax"] = ((out_features, blocks), torch.float32)
        return spec

    @classmethod
    def quantize_weight(cls, weight: torch.Tensor, config: NF4Config) -> dict[str, torch.Tensor]:
        quantized = nf4.quantize(weight, config.blocksize, config.double_quant)
        stored = {"weight": packing.pack(quantized.codes, _BITS)}
        if config.double_quant:
            stored["weight_absmax_codes"] = quantized.absmax_codes
            stored["weight_absmax_scale"] = quantized.absmax_scale
            stored["weight_absmax_offset"] = quantized.absmax_offset
        else:
            stored["weight_absmax"] = quantized.absmax
        return stored

    def codes(self) -> torch.Tensor:
        """Unpacked 4-bit codes `[out, blocks, blocksize]` (indices into `nf4.NF4_LEVELS`)."""
        return packing.unpack(self.weight, _BITS, self.config.blocksize)

    def absmax(self) -> torch.Tensor:
        """Per-block absmax `[out, blocks]` in float32, expanded from 8 bits under double quantization."""
        if not self.config.double_quant:
            return self.weight_absmax.float()
        return nf4.dequantize_absmax(
            self.weight_absmax_codes, self.weight_absmax_scale, self.weight_absmax_offset, nf4.ABSMAX_BLOCKSIZE
        )

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return nf4.dequantize(self.codes(), self.absmax(), self.in_features, dtype)

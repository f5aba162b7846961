"""An online Hadamard rotation of a quantized layer's input (SpinQuant's R4, QuaRot's online rotation).

A layer `y = W x` computes the same `y = (W R)(R x)` for any symmetric orthogonal `R`. Quantizing
`W R` instead of `W` spreads each input channel's outliers over a block of channels, so a group's
range is set by many weights instead of one, which matters most at 2-3 bits. The rotation is online:
the layer rotates its input on every call (two small matmuls), the stored codes are those of `W R`.

`R` is block-diagonal: a normalized Sylvester Hadamard matrix of `block` inputs on each block, `block`
the largest power of two dividing the layer's inputs (512 for 1,536 inputs; 4,096 for 28,672), so no
input is padded and the rotation needs no stored matrix. A block of `2^k` inputs is applied as the
Kronecker product of two Hadamard factors of about `2^(k/2)` each: `R x` costs `2 (b1 + b2)` multiply-adds
per input instead of `2 b`.

`R` is its own inverse (`R R = I`): rotating a rotated weight gives the original one back.
"""

import math

import torch

from quantlab.errors import ConfigError

MIN_BLOCK = 16  # fewer inputs per block spread an outlier too little to be worth a rotation
MAX_BLOCK = 1 << 14

_FACTORS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def rotation_block(in_features: int) -> int:
    """The Hadamard block of a layer with `in_features` inputs: the largest power of two dividing it."""
    block = min(in_features & -in_features, MAX_BLOCK)
    if block < MIN_BLOCK:
        raise ConfigError(
            f"a Hadamard rotation of {in_features} inputs would rotate blocks of {block}: it needs a multiple of "
            f"{MIN_BLOCK}; leave this layer out of rotate_inputs"
        )
    return block


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """`x R` along the last dimension (rows of a weight, or activations): the block-diagonal
    normalized Hadamard transform, in `x`'s dtype. Applying it twice gives `x` back."""
    width = x.shape[-1]
    left, right = factors(block)
    grouped = x.reshape(*x.shape[:-1], width // block, left, right)
    grouped = torch.matmul(grouped, hadamard(right, x.dtype, x.device))
    grouped = torch.matmul(hadamard(left, x.dtype, x.device), grouped)
    return grouped.reshape(x.shape)


def rotate_square(matrix: torch.Tensor, block: int) -> torch.Tensor:
    """`R M R` of a symmetric `[in, in]` matrix (the second moment of rotated inputs from the one of the inputs)."""
    return rotate(rotate(matrix, block).T.contiguous(), block)


def hadamard(size: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized Hadamard matrix `H / sqrt(size)` (Sylvester's construction, symmetric and orthogonal).

    Kept once per size, dtype and device: a layer rotating its input on every call builds none. Built outside
    inference mode, so a matrix first made while evaluating can still take part in training later."""
    key = (size, dtype, torch.device(device))
    matrix = _FACTORS.get(key)
    if matrix is None:
        if size < 1 or size & (size - 1):
            raise ConfigError(f"a Hadamard matrix needs a power of two, got {size}")
        with torch.inference_mode(False):
            matrix = torch.ones(1, 1, dtype=torch.float32)
            while matrix.shape[0] < size:
                matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
            matrix = (matrix / math.sqrt(size)).to(dtype=dtype, device=device)
        _FACTORS[key] = matrix
    return matrix


def factors(block: int) -> tuple[int, int]:
    """Two powers of two whose product is `block`, as close to each other as they can be."""
    bits = block.bit_length() - 1
    return 1 << (bits // 2), 1 << (bits - bits // 2)


def rotated_layers(model: torch.nn.Module) -> list[str]:
    """Names of the model's layers that rotate their input."""
    return [name for name, module in model.named_modules() if getattr(module, "input_rotation", 0)]


def refusal(layers: list[str], target: str) -> str:
    """The one-line message of an export whose format cannot rotate a layer's input."""
    more = f" (and {len(layers) - 1} more)" if len(layers) > 1 else ""
    return (
        f"{layers[0]}{more} rotates its input by a Hadamard matrix (rotate_inputs), which {target} cannot express; "
        f"quantize without rotate_inputs to export {target}, or export ONNX"
    )

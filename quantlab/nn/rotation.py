"""An online Hadamard rotation of a quantized layer's input (SpinQuant's R4, QuaRot's online rotation).

A layer `y = W x` computes the same `y = (W R)(R x)` for any symmetric orthogonal `R`. Quantizing
`W R` instead of `W` spreads each input channel's outliers over a block of channels, so a group's
range is set by many weights instead of one, which matters most at 2-3 bits. The rotation is online:
the layer rotates its input on every call (two small matmuls), the stored codes are those of `W R`.

`R` is block-diagonal: a normalized symmetric Hadamard matrix on each block of `block` inputs, so no
input is padded and the rotation needs no stored matrix. Two rules choose the block (`ROTATION_BLOCK_RULES`):
`power_of_two` (the default), the largest power of two dividing the inputs (64 of 576, 512 of 1,536),
and `largest`, the largest Hadamard order this module builds that divides them (whole rows of 576 =
36 x 16 or 1,536 = 12 x 128 inputs; 14,336 of 28,672).
Orders are `core x 2^k`: Sylvester's construction for the power of two, Paley's second construction
(symmetric, from a prime `q = 1 mod 4`, order `2 (q + 1)`) for a `core` of 12, 28, 36, 60, ...; their
Kronecker product is again symmetric and Hadamard. A block is applied as the Kronecker product of two
such factors of about its square root each: `R x` costs `2 (b1 + b2)` multiply-adds per input
instead of `2 b`.

`R` is its own inverse (`R R = I`): rotating a rotated weight gives the original one back.
"""

import math

import torch

from quantlab.config import ROTATION_BLOCK_RULES, QuantlabConfig
from quantlab.errors import ConfigError

MIN_BLOCK = 16  # fewer inputs per block spread an outlier too little to be worth a rotation
MAX_BLOCK = 1 << 14


def _is_prime(number: int) -> bool:
    return number > 1 and all(number % divisor for divisor in range(2, math.isqrt(number) + 1))


# Paley's second construction: a symmetric Hadamard matrix of order 2 (q + 1) from each prime q = 1 mod 4.
# Every such order is 4 x an odd number, and no two share the odd number.
PALEY_ORDERS = {2 * (q + 1): q for q in range(5, 128, 4) if _is_prime(q)}

_FACTORS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def rotation_block(in_features: int, rule: str) -> int:
    """The Hadamard block of a layer with `in_features` inputs under `rule` (one of `ROTATION_BLOCK_RULES`)."""
    block = min(in_features & -in_features, MAX_BLOCK)
    if rule == "largest":
        for core in PALEY_ORDERS:
            if in_features % core == 0:
                power = (in_features // core) & -(in_features // core)
                while power > 1 and core * power > MAX_BLOCK:
                    power //= 2
                if core * power <= MAX_BLOCK:
                    block = max(block, core * power)
    elif rule != "power_of_two":
        raise ConfigError(f"rotation block rule {rule!r} is not one of {ROTATION_BLOCK_RULES}")
    if block < MIN_BLOCK:
        raise ConfigError(
            f"a Hadamard rotation of {in_features} inputs would rotate blocks of {block}: it needs a multiple of "
            f"{MIN_BLOCK}; leave this layer out of rotate_inputs"
        )
    return block


def input_rotation_block(in_features: int, config: QuantlabConfig) -> int:
    """The Hadamard block a layer with `in_features` inputs rotates its input in under its resolved `config`
    (`config_for(layer)`), or 0 when that config does not rotate its input."""
    return rotation_block(in_features, config.rotation_blocks) if config.input_rotated else 0


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
    """The normalized Hadamard matrix `H / sqrt(size)` of order `size` (`_signs`: symmetric and orthogonal).

    Kept once per size, dtype and device: a layer rotating its input on every call builds none. Built outside
    inference mode, so a matrix first made while evaluating can still take part in training later."""
    key = (size, dtype, torch.device(device))
    matrix = _FACTORS.get(key)
    if matrix is None:
        with torch.inference_mode(False):
            matrix = (_signs(size) / math.sqrt(size)).to(dtype=dtype, device=device)
        _FACTORS[key] = matrix
    return matrix


def core_signs(block: int) -> torch.Tensor | None:
    """The ±1 Hadamard matrix (float32) of a block's non-power-of-two factor, or None when `block` is a power of
    two: what a kernel needs beside Sylvester's transform to rotate blocks of this size."""
    power = block & -block
    return None if block == power else _signs(4 * (block // power)).float()


def _signs(size: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order `size` = `core x 2^k` (core 1 or one of `PALEY_ORDERS`), symmetric."""
    power = size & -size if size > 0 else 0
    core = 1 if size == power else 4 * (size // power)
    if size < 1 or (core != 1 and (core not in PALEY_ORDERS or size % core)):
        raise ConfigError(
            f"no Hadamard matrix of order {size} is built here: it needs a power of two, or a power of two times "
            f"one of {', '.join(map(str, sorted(PALEY_ORDERS)[:4]))}, ..."
        )
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < size // core:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix if core == 1 else torch.kron(_paley(PALEY_ORDERS[core]), matrix)


def _paley(q: int) -> torch.Tensor:
    """Paley's second construction: from the symmetric conference matrix `C` of order q + 1 (q prime,
    q = 1 mod 4), `C (x) [[1, 1], [1, -1]] + I (x) [[1, -1], [-1, -1]]`, of order 2 (q + 1)."""
    squares = {(value * value) % q for value in range(1, q)}
    residue = torch.tensor([0.0] + [1.0 if value in squares else -1.0 for value in range(1, q)], dtype=torch.float64)
    index = torch.arange(q)
    conference = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    conference[0, 1:] = conference[1:, 0] = 1.0
    conference[1:, 1:] = residue[(index[None, :] - index[:, None]) % q]  # the Jacobsthal matrix
    plus = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    minus = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(conference, plus) + torch.kron(torch.eye(q + 1, dtype=torch.float64), minus)


def factors(block: int) -> tuple[int, int]:
    """Two Hadamard orders whose product is `block`, as close to each other as they can be: the left one
    holds the block's non-power-of-two core (their Kronecker product is then `hadamard(block)`)."""
    power = block & -block
    left = 1 if block == power else 4 * (block // power)
    right = block // left
    while right > 1 and abs(2 * left - right // 2) < abs(left - right):
        left, right = left * 2, right // 2
    return left, right


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

"""A block's Linear layers solved and quantized, each by one process when several calibrate together.

Every process holds the same statistics (summed over all of them: `quantlab.distributed`), so any
of them would solve a layer to the same codes. Rather than each solving every layer, each layer
goes to one rank, the least loaded so far when the layers are dealt largest first by GPTQ's
arithmetic (`d_in^2 * d_out + d_in^3`: the column sweep and the inverse Hessian), and that rank
broadcasts the layer's stored tensors to the others. Alone, every layer is solved here, in order.
Each input's statistics are released once the last layer this rank solves from them is done, so a
block's `in x in` matrices do not all wait for its widest layer (the MLP's down projection, last).
"""

from collections.abc import Callable

import torch
from torch import nn

from quantlab import distributed
from quantlab.config import QuantlabConfig
from quantlab.nn import QuantizedLinear
from quantlab.solvers import InputStats
from quantlab.utils.allocator import heap_for_temporaries, return_freed_memory


def quantize_layers(
    block: nn.Module,
    names: dict[str, str],
    config: QuantlabConfig,
    module_class: type[QuantizedLinear],
    stats: dict[str, InputStats],
    config_for: Callable[[str], QuantlabConfig] | None = None,
) -> dict[str, QuantizedLinear]:
    """Relative name → the quantized layer for each named float Linear of `block` (left as it is).
    `config_for`: each layer's config by its full name (default: `config.config_for`).
    The statistics are used up: each is released after the last layer solved from it here."""
    linears = {relative: block.get_submodule(relative) for relative in names}
    owners = solver_ranks([_cost(linear) for linear in linears.values()], distributed.world_size())
    resolve = config_for or config.config_for
    configs = {relative: resolve(full_name) for relative, full_name in names.items()}
    mine = [relative for relative, owner in zip(names, owners, strict=True) if owner == distributed.rank()]
    last_reader = {id(stats[relative]): relative for relative in mine}
    stored: dict[str, dict[str, torch.Tensor]] = {}
    for relative in mine:
        linear = linears[relative]
        with heap_for_temporaries():  # the solver's temporaries from warm heap pages, returned after
            stored[relative] = module_class.quantize_checked(
                linear.weight, configs[relative], names[relative], stats[relative]
            )
        if last_reader[id(stats[relative])] == relative:
            stats[relative].release()
        return_freed_memory()  # this solver's temporaries, before the next one's
    quantized = {}
    for relative, owner in zip(names, owners, strict=True):
        linear = linears[relative]
        tensors = stored.get(relative) or _empty(module_class, linear, configs[relative])
        for name in sorted(tensors):
            tensors[name] = distributed.broadcast_(tensors[name].contiguous(), owner)
        quantized[relative] = module_class.from_stored(linear, configs[relative], tensors)
    return quantized


def solver_ranks(costs: list[float], ranks: int) -> list[int]:
    """The rank solving each layer: largest first, each to the least loaded rank (the lowest on a tie)."""
    load = [0.0] * ranks
    owners = [0] * len(costs)
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner = min(range(ranks), key=lambda rank: (load[rank], rank))
        owners[index] = owner
        load[owner] += costs[index]
    return owners


def _cost(linear: nn.Linear) -> float:
    return float(linear.in_features) ** 2 * linear.out_features + float(linear.in_features) ** 3


def _empty(module_class: type[QuantizedLinear], linear: nn.Linear, config: QuantlabConfig) -> dict[str, torch.Tensor]:
    spec = module_class.storage_spec(linear.in_features, linear.out_features, config)
    device = linear.weight.device
    return {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in spec.items()}

"""A quantized model's layers swapped for trainable ones, and the trained codes and grids written back.

Training weights (`QATOptions.train="weights"`), each `QuantizedLinear` becomes a `FakeQuantLinear`
on its own storage layout, starting exactly from
its stored codes and grids (the first forward pass computes the checkpoint's weights bit for bit).
Where the float model's weight of the layer is known, the latent weight starts from it: a weight
that rounds to its stored code keeps its float value, one whose code the solver moved starts at
that code's level (`FakeQuantizedWeight`). Otherwise every weight starts at its level. Training
grids (`train="grids"`), it becomes a `GridTrainedLinear`: its codes frozen, its scales and zero
points trained, no float weight kept. With
`QATOptions.norm_lr_ratio` the normalization layers' float weights train too, with
`QATOptions.embedding_lr_ratio` the float embedding tables and output head. Writing back stores
what the fake quantizer computes as ordinary codes and grids: the model is then the same quantized
model as before, with other codes (and, if they trained, other float norms and tables).
"""

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from quantlab.distill.teacher import CompactLinear
from quantlab.nn import QuantizedLinear
from quantlab.nn.fake_quant import FakeQuantizedWeight, FakeQuantLinear
from quantlab.nn.grid_trained import GridTrainedLinear, TrainedGrid
from quantlab.qat.options import QATOptions


@dataclasses.dataclass
class SwappedLayer:
    """One layer while it trains: the quantized module taken out, and the fake-quantized one in its place."""

    quantized: QuantizedLinear
    fake: FakeQuantLinear | GridTrainedLinear
    float_start: bool  # the latent weight started from the float model's weight (else from the levels)

    @property
    def quantizer(self) -> FakeQuantizedWeight | TrainedGrid:
        return self.fake.weight_quantizer


def float_linear_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The `[out, in]` weights of a float model's Linear layers by module name (where training starts from);
    a teacher's weights held in 16 bits (`quantlab.distill.teacher`) as they are held."""
    kinds = (nn.Linear, CompactLinear)
    return {name: module.weight for name, module in model.named_modules() if isinstance(module, kinds)}


NORMALIZATION_TYPES = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)


def normalization_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of `model`'s normalization layers (torch's, and models' own `...RMSNorm`/`...LayerNorm`)."""
    found: dict[str, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        is_norm = isinstance(module, NORMALIZATION_TYPES) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
        if is_norm:
            prefix = f"{module_name}." if module_name else ""
            found.update({prefix + name: parameter for name, parameter in module.named_parameters(recurse=False)})
    return found


def embedding_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters of `model`'s embedding tables (`nn.Embedding`) and of an output head that stays a
    float `nn.Linear` (tied to the input table or not); a quantized head trains through its quantizer."""
    heads = set()
    for module in model.modules():
        head = module.get_output_embeddings() if callable(getattr(module, "get_output_embeddings", None)) else None
        if type(head) is nn.Linear:
            heads.add(id(head))
    found: dict[str, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Embedding) or id(module) in heads:
            prefix = f"{module_name}." if module_name else ""
            found.update({prefix + name: parameter for name, parameter in module.named_parameters(recurse=False)})
    return found


def fake_quantize(
    model: nn.Module, float_weights: Mapping[str, torch.Tensor] | None = None, options: QATOptions | None = None
) -> dict[str, SwappedLayer]:
    """Freeze `model` and put a trainable layer in place of each of its `QuantizedLinear` layers: a
    `FakeQuantLinear` (`options.train="weights"`, the default here) or a `GridTrainedLinear` ("grids").

    `float_weights`: the float model's weights by module name (`float_linear_weights`); a layer
    whose name or shape is not there starts from its stored levels (training weights only). The
    normalization layers' weights train too when `options.norm_lr_ratio` is set, the embedding tables and a
    float output head when `options.embedding_lr_ratio` is. Returns the swapped
    layers by name.
    """
    options = options or QATOptions(train="weights")
    float_weights = float_weights or {}
    model.requires_grad_(False)
    swapped: dict[str, SwappedLayer] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, QuantizedLinear):
            continue
        stored = module.stored_tensors()
        if options.train == "grids":
            grid = GridTrainedLinear(TrainedGrid.from_stored(module.layout, stored), module.bias, module.input_rotation)
            model.set_submodule(name, grid)
            swapped[name] = SwappedLayer(module, grid, False)
            continue
        weight = float_weights.get(name)
        float_start = weight is not None and tuple(weight.shape) == (module.out_features, module.in_features)
        if not float_start:
            weight = module.dequantize_weight(torch.float32)
        weight = module.stored_space(weight.detach().to(torch.float32))  # the latent weight the codes train from
        quantizer = FakeQuantizedWeight.from_solution(
            module.layout, weight, stored, options.max_offset, options.learn_scales
        )
        fake = FakeQuantLinear(quantizer, module.bias, module.input_rotation)
        model.set_submodule(name, fake)
        swapped[name] = SwappedLayer(module, fake, float_start)
    if options.norm_lr_ratio is not None:
        for parameter in normalization_parameters(model).values():
            parameter.requires_grad_(True)
    if options.embedding_lr_ratio is not None:
        for parameter in embedding_parameters(model).values():
            parameter.requires_grad_(True)
    return swapped


@torch.no_grad()
def write_back(model: nn.Module, swapped: Mapping[str, SwappedLayer]) -> None:
    """Store each fake quantizer's codes and grids in its quantized layer, and put the quantized layers back."""
    for name, layer in swapped.items():
        layer.quantized.load_stored(layer.quantizer.stored())
        model.set_submodule(name, layer.quantized)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[None]:
    """Every `nn.Dropout` of `model` at rate 0 inside the block (the rates are put back after).

    The student matches its float teacher, which runs in eval mode: noise on the student's side
    would only be learned away (BERT-style encoders drop 10 % of their activations in training)."""
    dropouts = [module for module in model.modules() if isinstance(module, nn.Dropout)]
    rates = [module.p for module in dropouts]
    for module in dropouts:
        module.p = 0.0
    try:
        yield
    finally:
        for module, rate in zip(dropouts, rates, strict=True):
            module.p = rate

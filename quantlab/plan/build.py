"""Building a `QuantizationPlan`: the layer selection, its checks, each layer's config and solver.

The one place that decides which layers a config quantizes: the quantizable Linear layers
(`quantlab.nn.kinds`) less the skip list (`modules_to_not_convert`, else transformers' default
of the output head and tied weights, plus the model's `_keep_in_fp32_modules`) and less the output
head when `embedding_bits` quantizes it as a vocabulary table; or exactly the layers a caller
names. `layer_options` and `rotate_inputs` must match layers of that selection, checked here
before any work (calibrating a large model takes hours).
"""

from collections.abc import Callable

from torch import nn

from quantlab.config import QuantlabConfig
from quantlab.errors import ConfigError, QuantizationError
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import (
    as_linear,
    fused_experts_shape,
    is_fused_experts,
    is_quantizable_linear,
    is_router,
    unhandled_kind,
)
from quantlab.nn.quantized_embedding import QuantizedTable, TiedOutputHead
from quantlab.nn.quantized_experts import QuantizedExperts
from quantlab.nn.rotation import rotation_block
from quantlab.plan.plan import FloatWeight, PlannedLayer, QuantizationPlan
from quantlab.registry import method_of
from quantlab.vocabulary import find_vocabulary, vocabulary_linears


def build_plan(model: nn.Module, config: QuantlabConfig, modules: list[str] | None = None) -> QuantizationPlan:
    """The plan of quantizing `model` (loaded or on the meta device) with `config`.

    `modules`: quantize exactly these Linear layers (default: the selection described above).
    Raises `ConfigError` for `layer_options` or `rotate_inputs` that match no selected layer."""
    module_class = method_of(config).module_class
    skipped = skip_list(model, config) if modules is None else []
    selected = _selection(model, config, modules, skipped)
    names = [name for name, module in model.named_modules() if is_quantizable_linear(module) and selected(name)]
    experts = _selected_experts(model, selected)
    check_layer_options(model, config, names, experts)
    solver = config.solver_object
    calibrated = _calibrated_layers(model, names + experts) if config.awq or solver.needs_calibration else set()
    layers = {}
    for name, module in model.named_modules():
        if name in experts:
            count, hidden, intermediate = fused_experts_shape(module)
            for projection, (inputs, outputs) in (("gate_up_proj", (hidden, 2 * intermediate)),
                                                  ("down_proj", (intermediate, hidden))):  # fmt: skip
                full = f"{name}.{projection}"
                layers[full] = PlannedLayer.make(full, inputs, outputs, config, module_class, name in calibrated, count)
        elif name in names:
            linear = as_linear(module)
            layers[name] = PlannedLayer.make(
                name, linear.in_features, linear.out_features, config, module_class, name in calibrated
            )
    tables = _tables(model, config)
    return QuantizationPlan(
        config=config,
        module_class=module_class,
        solver=solver,
        layers=layers,
        tables=tables,
        left_float=_left_float(model, config, layers, tables, skipped, modules is not None),
        skipped=skipped,
        calibration=describe_calibration(config),
    )


def skip_list(model: nn.Module, config: QuantlabConfig) -> list[str]:
    """The module names (or suffixes, prefixes, regexes) kept in float, as transformers' quantizers choose them."""
    if not (hasattr(model, "all_tied_weights_keys") and hasattr(model, "get_output_embeddings")):
        return list(config.modules_to_not_convert or [])
    from transformers.quantizers import HfQuantizer

    return HfQuantizer.get_modules_to_not_convert(
        model, config.modules_to_not_convert, getattr(model, "_keep_in_fp32_modules", None)
    )


def describe_calibration(config: QuantlabConfig) -> str | None:
    """The calibration data in words, or None when the config needs none."""
    if not config.needs_calibration:
        return None
    windows = f"{config.calibration_samples} windows of {config.calibration_seq_len} tokens"
    if config.self_calibration:
        return f"{windows} sampled from the float model itself"
    text = config.calibration_text or "the bundled WikiText-2 text after the evaluation windows"
    return f"{windows} of {text}"


def check_layer_options(model: nn.Module, config: QuantlabConfig, names: list[str], experts: list[str]) -> None:
    """Raise `ConfigError` if a `layer_options` entry names none of the Linear layers `names` nor a projection of
    the fused experts modules `experts`, or `rotate_inputs` matches none, or a layer it matches cannot be
    rotated."""
    _check_rotated_layers(model, config, names)
    if not config.layer_options:
        return
    known = names + [f"{name}.{projection}" for name in experts for projection in ("gate_up_proj", "down_proj")]
    unknown = sorted(set(config.layer_options) - set(known))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        example = f" (they are named like {names[0]!r})" if names else ""
        raise ConfigError(
            f"{config.method}: layer_options names {unknown[0]!r}{more}, which is not a layer this model "
            f"quantizes{example}: correct the name, or remove the entry"
        )


def _check_rotated_layers(model: nn.Module, config: QuantlabConfig, names: list[str]) -> None:
    if not config.rotate_inputs:
        return
    rotated = [name for name in names if config.rotates_input_of(name)]
    if not rotated:
        example = f" (they are named like {names[-1]!r})" if names else ""
        raise ConfigError(
            f"{config.method}: rotate_inputs={list(config.rotate_inputs)!r} matches no layer this model quantizes"
            f"{example}: correct the names, or drop rotate_inputs"
        )
    for name in rotated:
        try:
            rotation_block(as_linear(model.get_submodule(name)).in_features, config.rotation_blocks)
        except ConfigError as error:
            raise ConfigError(f"{config.method}: {name}: {error}") from None


def _selection(
    model: nn.Module, config: QuantlabConfig, modules: list[str] | None, skipped: list[str]
) -> Callable[[str], bool]:
    from transformers.quantizers.quantizers_utils import should_convert_module

    if modules is not None:
        _check_targets(model, modules)
        return set(modules).__contains__
    head = vocabulary_linears(model, config)  # the output head, when embedding_bits makes it a table
    return lambda name: name not in head and should_convert_module(name, skipped)


def _selected_experts(model: nn.Module, selected: Callable[[str], bool]) -> list[str]:
    """The fused experts modules whose two projections the selection keeps."""
    return [
        name
        for name, module in model.named_modules()
        if is_fused_experts(module) and selected(f"{name}.gate_up_proj") and selected(f"{name}.down_proj")
    ]


def _check_targets(model: nn.Module, modules: list[str]) -> None:
    named = dict(model.named_modules())
    for name in modules:
        module = named.get(name)
        if module is None:
            raise QuantizationError(f"no module named {name!r} in {type(model).__name__}; check the name")
        if not is_quantizable_linear(module):
            raise QuantizationError(
                f"{name} is a {type(module).__name__}, not an nn.Linear layer: quantlab quantizes Linear layers "
                f"only; target its Linear sub-layers instead"
            )


def _calibrated_layers(model: nn.Module, names: list[str]) -> set[str]:
    """The selected layers inside the repeated blocks: the ones the calibrated schedule solves."""
    from quantlab.calibration.blocks import find_blocks

    try:
        prefix, _ = find_blocks(model)
    except QuantizationError:
        return set()  # calibrating will refuse the model, with the reason
    return {name for name in names if name.startswith(f"{prefix}.")}  # Linear layers and experts modules


def _tables(model: nn.Module, config: QuantlabConfig) -> list[str]:
    """The vocabulary tables `embedding_bits` quantizes: the input embedding, and the output head (tied: read
    from the embedding's codes)."""
    if config.embedding_bits is None:
        return []
    vocabulary = find_vocabulary(model)
    tables = [vocabulary.embedding] if vocabulary.embedding is not None else []
    if vocabulary.head is not None:
        tables.append(f"{vocabulary.head} (tied)" if vocabulary.tied else vocabulary.head)
    return tables


def _left_float(
    model: nn.Module,
    config: QuantlabConfig,
    layers: dict[str, PlannedLayer],
    tables: list[str],
    skipped: list[str],
    named_only: bool,
) -> list[FloatWeight]:
    """Every float weight of two or more dimensions the plan does not quantize, with the reason."""

    vocabulary = find_vocabulary(model)
    vocabulary_names = {vocabulary.embedding, vocabulary.head} - {None}
    experts = {name.rpartition(".")[0] for name, layer in layers.items() if layer.experts}
    quantized_tables = {table.removesuffix(" (tied)") for table in tables}
    embeddings = {name for name, module in model.named_modules() if isinstance(module, nn.Embedding)}
    skip_reason = (
        "skipped (modules_to_not_convert)"
        if config.modules_to_not_convert is not None
        else "kept in float by default (tied weights, the last layer)"
    )
    seen: set[int] = set()
    left: list[FloatWeight] = []
    for name, module in model.named_modules():
        if name in layers or name in quantized_tables or isinstance(module, (QuantizedLinear, QuantizedTable)):
            continue
        if name in experts or isinstance(module, QuantizedExperts):
            continue
        if isinstance(module, TiedOutputHead):
            continue
        for attribute, parameter in module.named_parameters(recurse=False):
            if parameter is None or parameter.dim() < 2 or id(parameter) in seen:
                continue
            if vocabulary.tied and name == vocabulary.head:
                continue  # the embedding's table, stored once (on the meta device the two are not tied yet)
            seen.add(id(parameter))
            full = f"{name}.{attribute}" if name else attribute
            in_vocabulary = name in vocabulary_names or name in embeddings
            why, chosen = _why_float(
                module, attribute, parameter.dim(), name, skipped, in_vocabulary, named_only, skip_reason
            )
            left.append(FloatWeight(full, tuple(parameter.shape), why, chosen, in_vocabulary))
    return left


def _why_float(
    module: nn.Module,
    attribute: str,
    dimensions: int,
    name: str,
    skipped: list[str],
    in_vocabulary: bool,
    named_only: bool,
    skip_reason: str,
) -> tuple[str, bool]:
    """(reason, whether it was kept on purpose: chosen, or named by the skip list)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    if in_vocabulary and isinstance(module, nn.Embedding):
        return "embedding table (embedding_bits quantizes it)", True
    if is_quantizable_linear(module):
        if named_only:
            return "not among the layers named", True
        if in_vocabulary:
            return "output head (kept in float by default; embedding_bits quantizes it)", True
        if skipped and not should_convert_module(name, skipped):
            return skip_reason, True
        return "not selected", True
    if is_router(module, name):
        return "router (kept in float: its few weights choose the experts)", True
    kept_by_user = bool(skipped) and not should_convert_module(name, skipped)
    return f"no quantized module for a {unhandled_kind(module, attribute, dimensions)}", kept_by_user

"""transformers 5 integration: one `HfQuantizer` subclass per method, quantizing while loading.

`from_pretrained(path, quantization_config=config)` builds the model on the meta device,
swaps its Linear layers for the method's quantized layer, then quantizes each float weight
as the loader streams it in (`get_quantize_ops`): the float model never exists in memory.
A checkpoint saved from such a model reloads through the same quantizer on its pre-quantized
path, the stored tensors landing straight in the layers' buffers. A mixture of experts' stored
tensors may come fused (as quantlab saves them) or one Linear layer per expert (as an imported
compressed-tensors checkpoint has them): transformers' conversions merge the per-expert codes, and
copies of them the per-expert scales and zero points (`experts_companion_conversions`).

A calibrated config (GPTQ, AWQ, mixed precision, self-calibration) loads the float model whole
and then quantizes it block by block: transformers hands the quantizer one tensor at a time with
no inputs to calibrate on, assigns every tensor it reads to the model, and gives the quantizer
control again only once all of them are loaded (a weight it did not assign would be re-initialised
in memory). Block i+1's calibration inputs come from the quantized block i, so no per-tensor
operation can do it. `quantlab quantize` (`quantlab.workflows.quantize`) reads the checkpoint
itself and holds one block at a time (`quantlab.streaming`); use it for models that do not fit.

A causal LM loaded this way also gets quantlab's chunked cross-entropy as its `loss_function`
(`quantlab.integrations.chunked_loss`: same loss and gradients, one logits-sized tensor fewer at
the peak of a training step); `QUANTLAB_CHUNKED_LOSS=0` keeps transformers' own.
"""

import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from transformers.core_model_loading import ConversionOps, WeightConverter, WeightTransform
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.quantizers.quantizers_utils import get_module_from_name
from transformers.utils.quantization_config import QuantizationConfigMixin

from quantlab import registry
from quantlab.config import QuantlabConfig, transformers_name
from quantlab.errors import QuantlabError, UnknownMethodError
from quantlab.integrations.chunked_loss import use_chunked_loss
from quantlab.nn import QuantizedLinear
from quantlab.nn.kinds import is_transposed_linear, linear_weight
from quantlab.nn.quantized_embedding import QuantizedTable
from quantlab.nn.quantized_experts import PROJECTIONS, QuantizedExperts, stored_name
from quantlab.plan import QuantizationPlan, build_plan, empty_layers, quantize_loaded
from quantlab.registry import Method
from quantlab.replacement import dequantize_layers
from quantlab.utils.pages import release_mapped_tensor
from quantlab.verification import verify_checkpoint_files, verify_loaded_layer

_QUANTIZERS: dict[str, type[HfQuantizer]] = {}


def install() -> None:
    """Subscribe to the method registry (every method, built-in or plugin, gets its config and
    quantizer registered with transformers) and hold the names of plugins not loaded yet."""
    registry.subscribe(register_method)
    reserve_plugin_methods()


def reserve_plugin_methods() -> None:
    """Let transformers read checkpoints of installed plugins before the plugins are imported."""
    reserve_plugin_names(registry.pending_plugin_methods())


def register_method(method: Method) -> None:
    """The registry's subscriber: `method`'s config and `HfQuantizer` (its own, or one made for its module)."""
    quantizer_class = method.quantizer_class or make_quantizer_class(method.module_class)
    _QUANTIZERS[method.name] = quantizer_class
    register_with_transformers(method.config_class, quantizer_class)


def quantizer_class_of(method: Method) -> type[HfQuantizer]:
    """The `HfQuantizer` registered with transformers for `method`."""
    if method.name not in _QUANTIZERS:
        register_method(method)
    return _QUANTIZERS[method.name]


def register_with_transformers(config_class: type[QuantlabConfig], quantizer_class: type[HfQuantizer]) -> None:
    name = config_class(modules_to_not_convert=None).quant_method
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(name) is PendingPluginConfig:
        del AUTO_QUANTIZATION_CONFIG_MAPPING[name]
    if AUTO_QUANTIZER_MAPPING.get(name) is PendingPluginQuantizer:
        del AUTO_QUANTIZER_MAPPING[name]
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(name) is not config_class:
        register_quantization_config(name)(config_class)
    if AUTO_QUANTIZER_MAPPING.get(name) is not quantizer_class:
        register_quantizer(name)(quantizer_class)


class PendingPluginConfig(QuantizationConfigMixin):
    """Holds a plugin method's place in transformers' table until a checkpoint needs it.

    transformers only reads checkpoints whose `quant_method` it has registered; plugins are
    imported lazily, so each installed plugin's name gets this stand-in when quantlab is
    imported. Reading such a checkpoint's config loads the plugins (which replace the
    stand-in with the real config and quantizer) and hands over to the real config class.
    """

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], return_unused_kwargs: bool = False, **kwargs: Any) -> Any:
        registry.discover_plugins()
        name = config_dict.get("quant_method")
        target = AUTO_QUANTIZATION_CONFIG_MAPPING.get(name)
        if target is None or target is cls:
            raise UnknownMethodError(
                f"this checkpoint was quantized with {name!r}, whose plugin is installed but did not register it "
                "(see the warning above); reinstall the plugin or upgrade it to match quantlab"
            )
        return target.from_dict(config_dict, return_unused_kwargs=return_unused_kwargs, **kwargs)


class PendingPluginQuantizer(HfQuantizer):
    """Holds a plugin method's place in transformers' quantizer table until a model is loaded with it.

    `from_pretrained(path, quantization_config=PluginConfig())` looks the quantizer up by name, and
    importing a plugin's config class does not register the plugin; building this stand-in loads the
    plugins and returns the real quantizer instead.
    """

    def __new__(cls, quantization_config: QuantizationConfigMixin, **kwargs: Any) -> HfQuantizer:
        registry.discover_plugins()
        name = quantization_config.quant_method
        target = AUTO_QUANTIZER_MAPPING.get(name)
        if target is None or target is cls:
            raise UnknownMethodError(
                f"quantization method {name!r} belongs to a plugin that is installed but did not register it "
                "(see the warning above); reinstall the plugin or upgrade it to match quantlab"
            )
        return target(quantization_config, **kwargs)


def reserve_plugin_names(method_names: list[str]) -> None:
    """Put a `PendingPluginConfig` and a `PendingPluginQuantizer` under the transformers name of each
    method not registered yet."""
    for method in method_names:
        AUTO_QUANTIZATION_CONFIG_MAPPING.setdefault(transformers_name(method), PendingPluginConfig)
        AUTO_QUANTIZER_MAPPING.setdefault(transformers_name(method), PendingPluginQuantizer)


def make_quantizer_class(module_class: type[QuantizedLinear]) -> type["QuantlabHfQuantizer"]:
    name = module_class.config_class.__name__.removesuffix("Config") + "HfQuantizer"
    return type(name, (QuantlabHfQuantizer,), {"module_class": module_class, "__module__": module_class.__module__})


class QuantlabHfQuantizer(HfQuantizer):
    """Quantizes a method's layers while transformers loads a checkpoint."""

    module_class: ClassVar[type[QuantizedLinear]]
    requires_calibration = False

    def __init__(self, quantization_config: QuantlabConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        # Names only: the storage layout does not depend on the layer's shape.
        self.serialized_names = {"weight": list(self.module_class.storage_spec(256, 1, quantization_config))}
        self.modules_to_not_convert: list[str] = []
        self.errors: list[QuantlabError] = []
        self.plan: QuantizationPlan | None = None  # built from the model before its weights load
        self.companion_conversions: list[WeightConverter] = []  # experts' per-expert scales and zero points
        self.transposed: set[str] = set()  # layers whose checkpoint weight is `[in, out]` (GPT-2's Conv1D)

    def param_needs_quantization(self, model: torch.nn.Module, param_name: str, **kwargs: Any) -> bool:
        if self.pre_quantized:
            return False
        module, tensor_name = get_module_from_name(model, param_name)
        if isinstance(module, QuantizedExperts):
            return tensor_name in PROJECTIONS
        return isinstance(module, (self.module_class, QuantizedTable)) and tensor_name == "weight"

    @property
    def calibrates_after_loading(self) -> bool:
        """A calibrated solver loads the float weights, then quantizes block by block on calibration text."""
        return not self.pre_quantized and self.quantization_config.needs_calibration

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> None:
        self.plan = build_plan(model, self.quantization_config)
        self.modules_to_not_convert = self.plan.skipped
        if not self.pre_quantized:
            self.plan.warn()
        if self.calibrates_after_loading:
            return
        self.transposed = {name for name, module in model.named_modules() if is_transposed_linear(module)}
        empty_layers(model, self.plan)
        if self.pre_quantized:
            self._verify_files(model)

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        if self.errors:
            raise self.errors[0]
        if self.pre_quantized:
            for name, layer in _quantized_layers(model).items():
                verify_loaded_layer(name, layer)
        if self.calibrates_after_loading:
            self._calibrate(model)
        _forget_quantize_operations(model)
        _forget_conversions(model, self.companion_conversions)
        use_chunked_loss(model)
        return model

    def update_weight_conversions(
        self, weight_conversions: list[WeightTransform], model: torch.nn.Module
    ) -> list[WeightTransform]:
        """transformers' conversions, plus one per stored companion of a quantized experts projection (see
        `experts_companion_conversions`): transformers adds those for parameters only, and `QuantizedExperts`
        keeps its stored tensors as buffers."""
        updated = super().update_weight_conversions(weight_conversions, model)
        self.companion_conversions = experts_companion_conversions(weight_conversions, model)
        return updated + self.companion_conversions

    def _verify_files(self, model: torch.nn.Module) -> None:
        """A damaged or edited checkpoint stops before loading, with one line naming the tensor."""
        directory = Path(getattr(model.config, "_name_or_path", "") or getattr(model, "name_or_path", "") or "")
        if str(directory) and directory.is_dir():
            verify_checkpoint_files(directory, _quantized_layers(model))

    def _calibrate(self, model: torch.nn.Module) -> None:
        config = self.plan.config
        tokenizer = None if config.self_calibration else _tokenizer_of(model)  # self-calibration reads no text
        quantize_loaded(model, self.plan, None, tokenizer)

    def _dequantize(self, model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
        return dequantize_layers(model, dtype)

    def get_quantize_ops(self) -> ConversionOps:
        return QuantizeOnLoad(self)

    def is_serializable(self) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return True

    @property
    def is_compileable(self) -> bool:
        """torch.compile traces quantized layers: the native kernels are torch operators with fake
        implementations, the reference kernel is plain torch (`quantlab.generation` builds on this)."""
        return True


class QuantizeOnLoad(ConversionOps):
    """Quantizes one float weight as it is loaded, returning the layer's stored tensors.

    transformers turns exceptions raised here into a long loading report; a `QuantlabError`
    (NaN weights, for example) is instead kept and raised once loading is over, so the user
    reads one clear message. Layers after the first error are not quantized, only filled.
    """

    def __init__(self, hf_quantizer: QuantlabHfQuantizer) -> None:
        self.hf_quantizer = hf_quantizer

    def convert(
        self, input_dict: dict[str, Any], model: torch.nn.Module | None = None, **kwargs: Any
    ) -> dict[str, torch.Tensor]:
        target_key, value = next(iter(input_dict.items()))
        weight = value[0] if isinstance(value, list) else value
        layer_name, _, tensor_name = target_key.rpartition(".")
        module, _ = get_module_from_name(model, target_key)
        stored = None
        if not self.hf_quantizer.errors:
            try:
                transposed = layer_name in self.hf_quantizer.transposed
                stored = _quantize_one(module, tensor_name, linear_weight(weight, transposed), layer_name)
            except QuantlabError as error:
                self.hf_quantizer.errors.append(error)
        release_mapped_tensor(weight)  # its checkpoint pages would otherwise stay resident until the end
        if stored is None:
            stored = _zeros_like_stored(module, tensor_name)
        return {f"{layer_name}.{name}": tensor for name, tensor in stored.items()}


def _quantize_one(
    module: torch.nn.Module, tensor_name: str, weight: torch.Tensor, name: str
) -> dict[str, torch.Tensor]:
    """The stored tensors of one float weight as it is loaded: a Linear layer's, a table's, or a fused experts
    projection's (every expert's slice, stacked)."""
    if isinstance(module, QuantizedExperts):
        return module.quantize_projection(tensor_name, weight, f"{name}.{tensor_name}")
    return module.quantize_checked(weight, module.config, name)


def _zeros_like_stored(module: torch.nn.Module, tensor_name: str) -> dict[str, torch.Tensor]:
    """Placeholders for a weight not quantized after an earlier error (loading stops with that error)."""
    if isinstance(module, QuantizedExperts):
        names = [name for name in module.stored_names if name == tensor_name or name.startswith(f"{tensor_name}_")]
        return {name: torch.zeros(getattr(module, name).shape, dtype=getattr(module, name).dtype) for name in names}
    spec = module.storage_spec(module.in_features, module.out_features, module.config)
    return {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()}


def _forget_quantize_operations(model: torch.nn.Module) -> None:
    """Drop the quantize step from the checkpoint conversions the loader attached to the model: loading is over,
    and `save_pretrained` can only reverse conversions without one (a fused experts projection's codes are then
    written back per expert, as its float weights were read)."""
    for conversion in getattr(model, "_weight_conversions", None) or []:
        if getattr(conversion, "quantization_operation", None) is not None:
            conversion.quantization_operation = None


def experts_companion_conversions(conversions: list[WeightTransform], model: torch.nn.Module) -> list[WeightConverter]:
    """For each conversion merging per-expert `.weight` tensors into a projection of a `QuantizedExperts` (its
    codes), a copy merging the experts' other stored tensors alike: `experts.*.gate_proj.weight_scale` into
    `experts.gate_up_proj_scale`. A checkpoint storing experts per expert (a compressed-tensors one, as quantlab
    converts it) thus loads every stored tensor, not only the codes; one storing them fused matches none."""
    layouts: dict[str, set[str]] = {}  # full projection name -> its stored tensors other than the codes
    for name, module in model.named_modules():
        if isinstance(module, QuantizedExperts):
            for projection, layout in module.layouts.items():
                layouts[f"{name}.{projection}"] = {tensor for tensor in layout.tensors if tensor != "weight"}
    copies = []
    for conversion in conversions:
        if not isinstance(conversion, WeightConverter):
            continue
        sources, targets = conversion._original_source_patterns, conversion._original_target_patterns
        projection = next((p for p in PROJECTIONS if len(targets) == 1 and targets[0].endswith(p)), None)
        if projection is None or not all(source.endswith(".weight") for source in sources):
            continue
        pattern = re.compile(f"{targets[0]}$")
        tensors = {tensor for name, names in layouts.items() if pattern.search(name) for tensor in names}
        for tensor in sorted(tensors):
            copies.append(
                conversion.copy(
                    [source.removesuffix("weight") + tensor for source in sources],
                    [targets[0].removesuffix(projection) + stored_name(projection, tensor)],
                    operations=list(conversion.operations),
                )
            )
    return copies


def _forget_conversions(model: torch.nn.Module, dropped: list[WeightConverter]) -> None:
    """Drop `dropped` from the conversions the loader attached to the model: `save_pretrained` then writes the
    experts' companions fused, as quantlab writes them, whichever layout they were read from."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if not any(c is d for d in dropped)]


def _tokenizer_of(model: torch.nn.Module) -> Any:
    """The tokenizer saved beside the checkpoint being loaded: calibration text must be tokenized."""
    from transformers import AutoTokenizer

    path = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as error:
        raise QuantlabError(
            f"calibrating needs the model's tokenizer, and none loads from {path!r} ({error}); save the tokenizer "
            f"beside the checkpoint, or load in float and call quantlab.quantize(model, config, calibration=ids)"
        ) from error


def _quantized_layers(model: torch.nn.Module) -> dict[str, QuantizedLinear | QuantizedTable]:
    """Every module that stores quantized tensors: the Linear layers and the vocabulary tables."""
    return {
        name: module for name, module in model.named_modules() if isinstance(module, (QuantizedLinear, QuantizedTable))
    }

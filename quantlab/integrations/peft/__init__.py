"""PEFT (and transformers' parameter counts) know quantlab's quantized layers, with no call needed.

Installed by `import quantlab`, which the start-up hook (`_quantlab_autoload.py`) performs in
every process that loads transformers' model code, `import peft` included: the standard
QLoRA recipe runs unchanged on a quantlab model in a script that never imports quantlab.
Nothing here imports PEFT: each adaptation runs when the PEFT module it concerns has been
imported (`quantlab.utils.import_hooks`), or at once if it already is; the adaptations live
in this package (`targets`, `kbit`, `merge`, `lora`) and in `quantlab.integrations.parameter_count`.

Public hooks used (nothing patched):
- transformers' quantizer registry (`register_quantization_config`/`register_quantizer`) and
  the attributes its `HfQuantizer` sets (`is_quantized`, `quantization_method`, `hf_quantizer`),
  which PEFT and `Trainer` read; `HfQuantizer.is_trainable` lets `Trainer` train adapters;
- PEFT's custom-layer API, `LoraConfig._register_custom_module({QuantizedLinear: QuantizedLoraLinear})`
  (experimental, per config instance: `LoraConfig.__post_init__` is wrapped so every config,
  including the one `PeftModel.from_pretrained` reads back, gets the mapping);
- PEFT's per-layer `merge`/`unmerge`/`get_delta_weight` contract, which `merge_and_unload`,
  `unload` and `merge_adapter` call on `QuantizedLoraLinear`.

Wrapped, where PEFT or transformers has no hook (each wrapper calls the original first and
only adds to its result, so models without quantlab layers behave exactly as before):
- `peft.tuners.tuners_utils._maybe_include_all_linear_layers`: "all-linear" adds quantized layers;
- `peft.prepare_model_for_kbit_training`: gradient checkpointing as for bitsandbytes;
- `PreTrainedModel.num_parameters` / `get_memory_footprint`, `PeftModel.get_nb_trainable_parameters`:
  quantized weights count as parameters;
- `LoraModel.merge_and_unload` / `merge_adapter`: one warning with the measured re-quantization error.

Set `QUANTLAB_PEFT=0` to leave PEFT and transformers untouched.
"""

import functools
from typing import Any

from quantlab.integrations.parameter_count import (
    patch_peft_counts,
    patch_peft_mixed_counts,
    patch_transformers_counts,
)
from quantlab.integrations.peft.kbit import patch_prepare_model_for_kbit_training
from quantlab.integrations.peft.merge import patch_lora_merges
from quantlab.integrations.peft.targets import patch_all_linear
from quantlab.nn import QuantizedLinear
from quantlab.utils.environment import switched_on
from quantlab.utils.import_hooks import after_import

_PATCHED = "_quantlab_registers_lora_layers"


def install() -> None:
    """Adapt PEFT and transformers now where they are loaded, else as soon as they load."""
    if not switched_on("QUANTLAB_PEFT"):
        return
    after_import("peft.tuners.lora.config", "LoraConfig", lambda module: patch_lora_config(module.LoraConfig))
    after_import("peft.tuners.tuners_utils", "_maybe_include_all_linear_layers", patch_all_linear)
    after_import("peft.utils.other", "prepare_model_for_kbit_training", patch_prepare_model_for_kbit_training)
    after_import("peft.tuners.lora.model", "LoraModel", patch_lora_merges)
    after_import("peft.peft_model", "PeftModel", patch_peft_counts)
    after_import("peft.mixed_model", "PeftMixedModel", patch_peft_mixed_counts)
    after_import("transformers.modeling_utils", "PreTrainedModel", patch_transformers_counts)


def lora_layer_mapping() -> dict[type, type]:
    """The custom-module mapping every `LoraConfig` receives: quantized layer → LoRA layer."""
    from quantlab.integrations.peft.lora import QuantizedLoraLinear  # imports PEFT: only once PEFT is loaded

    return {QuantizedLinear: QuantizedLoraLinear}


def patch_lora_config(lora_config_class: type) -> None:
    """Make `lora_config_class.__post_init__` register quantlab's LoRA layer on each instance."""
    original = lora_config_class.__post_init__
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def __post_init__(self: Any) -> None:
        original(self)
        self._register_custom_module(lora_layer_mapping())

    setattr(__post_init__, _PATCHED, True)
    lora_config_class.__post_init__ = __post_init__


install()

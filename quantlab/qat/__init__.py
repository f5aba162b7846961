"""Quantization-aware training with distillation: a quantized model trained through fake quantizers.

```python
from quantlab.qat import QATOptions, train_quantized

student = AutoModelForCausalLM.from_pretrained("smollm2-3bit-gptq")   # a quantlab checkpoint
teacher = AutoModelForCausalLM.from_pretrained("smollm2")             # its float model
result = train_quantized(student, teacher, training_arguments({"output_dir": "runs/qat", "max_steps": 100,
                         "learning_rate": 5e-3}), data.train, tokenizer, options=QATOptions())
student.save_pretrained("smollm2-3bit-qat")                           # same format, trained codes
```
Every `QuantizedLinear` trains as a `FakeQuantLinear` on its own storage layout (straight-through
rounding, LSQ-style learnable scales and zero points) against the KL divergence from the frozen
float teacher on transformers' Trainer, and is written back as stored codes and grids equal bit
for bit to what the fake quantizer computed.
"""

import importlib
from typing import Any

# name -> the module defining it, imported on first use: the command line reads `QATOptions` to build its flags
# without importing the trainer (transformers' Trainer and PEFT: over a second).
_EXPORTS = {
    "ProjectQuantizers": "quantlab.qat.trainer",
    "QATOptions": "quantlab.qat.options",
    "QATResult": "quantlab.qat.run",
    "QATTrainer": "quantlab.qat.trainer",
    "SwappedLayer": "quantlab.qat.swap",
    "fake_quantize": "quantlab.qat.swap",
    "float_linear_weights": "quantlab.qat.swap",
    "parameter_groups": "quantlab.qat.trainer",
    "train_quantized": "quantlab.qat.run",
    "write_back": "quantlab.qat.swap",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)

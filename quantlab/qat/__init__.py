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

from quantlab.qat.options import QATOptions
from quantlab.qat.run import QATResult, train_quantized
from quantlab.qat.swap import SwappedLayer, fake_quantize, float_linear_weights, write_back
from quantlab.qat.trainer import ProjectQuantizers, QATTrainer, parameter_groups

__all__ = [
    "ProjectQuantizers",
    "QATOptions",
    "QATResult",
    "QATTrainer",
    "SwappedLayer",
    "fake_quantize",
    "float_linear_weights",
    "parameter_groups",
    "train_quantized",
    "write_back",
]

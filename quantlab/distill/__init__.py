"""Knowledge distillation on `transformers.Trainer` (a `compute_loss` override).

```python
from quantlab.distill import DistillationConfig, DistillationTrainer

trainer = DistillationTrainer(student, teacher, training_arguments({"output_dir": "runs/kd", "max_steps": 200}),
                              data.train, distillation=DistillationConfig(alpha=0.5, temperature=2.0),
                              eval_windows=data.eval_windows)
trainer.train()
```
The teacher may be float or quantized; the student smaller, pruned (its masks are held) or
quantized with LoRA adapters. They must share a vocabulary.
"""

from quantlab.distill.compat import VocabularyMismatchError, check_vocabularies, vocabulary_size
from quantlab.distill.config import DistillationConfig
from quantlab.distill.hidden import HiddenStateProjection, hidden_state_error
from quantlab.distill.loss import DistillationLoss, token_kl
from quantlab.distill.recovery import recover
from quantlab.distill.student import check_student, distill, finished_student, freeze_embeddings, trainable_student
from quantlab.distill.trainer import DistillationModel, DistillationTrainer, distillation_trainer

__all__ = [
    "DistillationConfig",
    "DistillationLoss",
    "DistillationModel",
    "DistillationTrainer",
    "HiddenStateProjection",
    "VocabularyMismatchError",
    "check_student",
    "check_vocabularies",
    "distill",
    "distillation_trainer",
    "finished_student",
    "freeze_embeddings",
    "hidden_state_error",
    "recover",
    "token_kl",
    "trainable_student",
    "vocabulary_size",
]

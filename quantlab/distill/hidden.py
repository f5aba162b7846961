"""Hidden-state matching: a learned projection from the student's hidden size to the teacher's.

The projection trains with the student (the loop optimizes and checkpoints it as an extra
module) and is thrown away afterwards. When the sizes are equal it starts as the identity, so
matching starts from the student's own states rather than from a random map.
"""

import torch
from torch import nn


class HiddenStateProjection(nn.Module):
    """One `Linear(student_size, teacher_size)` per matched pair of layers."""

    def __init__(self, student_size: int, teacher_size: int, pairs: int = 1) -> None:
        super().__init__()
        self.projections = nn.ModuleList(nn.Linear(student_size, teacher_size, bias=False) for _ in range(pairs))
        if student_size == teacher_size:
            with torch.no_grad():
                for projection in self.projections:
                    projection.weight.copy_(torch.eye(student_size))

    def forward(self, hidden_states: list[torch.Tensor]) -> list[torch.Tensor]:
        return [projection(h) for projection, h in zip(self.projections, hidden_states, strict=True)]


def hidden_state_error(projected: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
    """Per-token mean squared error over the hidden size, summed over pairs: `[tokens]`."""
    total = None
    for student, teacher in zip(projected, targets, strict=True):
        error = (student.float() - teacher.float()).pow(2).mean(-1)
        total = error if total is None else total + error
    return total

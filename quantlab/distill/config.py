"""`DistillationConfig`: the weights and temperature of the distillation loss, checked once."""

import dataclasses

from quantlab.errors import ConfigError


@dataclasses.dataclass
class DistillationConfig:
    """Loss `alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE + hidden_weight * MSE`.

    `alpha`: share of the soft-target term (Hinton et al. 2015, arXiv 1503.02531); the `T^2`
    factor keeps its gradients on the scale of the cross-entropy's whatever the temperature.
    `temperature`: above 1 it softens both distributions, so the student also learns the
    teacher's ranking of wrong tokens. `hidden_weight`: weight of hidden-state matching
    (FitNets, arXiv 1412.6550), the mean squared error between a learned linear projection of
    the student's hidden states and the teacher's; 0 turns it off. `hidden_layers`: pairs
    `(student index, teacher index)` into the models' `hidden_states` (0 is the embeddings,
    -1 the last layer); default `[(-1, -1)]`.

    An encoder (a sentence-embedding model) has no next-token distribution: it is matched by the cosine
    distance of its last hidden states at every token, plus `embedding_weight` times the cosine distance
    of its mean-pooled sentence embeddings, one term per example: the quantity sentence-embedding users
    compare, with every line counted once however many tokens it has; 0 turns it off.
    """

    alpha: float = 0.5
    temperature: float = 2.0
    hidden_weight: float = 0.0
    hidden_layers: list[tuple[int, int]] | None = None
    embedding_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.hidden_layers is not None:
            self.hidden_layers = [tuple(pair) for pair in self.hidden_layers]  # type: ignore[misc]
        self.validate()

    def validate(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha={self.alpha!r} must lie in [0, 1] (the share of the distillation term)")
        if not self.temperature > 0:
            raise ConfigError(f"temperature={self.temperature!r} must be > 0")
        if not self.hidden_weight >= 0:
            raise ConfigError(f"hidden_weight={self.hidden_weight!r} must be >= 0 (0 turns hidden matching off)")
        if not self.embedding_weight >= 0:
            raise ConfigError(f"embedding_weight={self.embedding_weight!r} must be >= 0 (0 turns it off)")
        if self.hidden_layers is not None:
            if not self.hidden_layers:
                raise ConfigError("hidden_layers is empty; give (student, teacher) index pairs or None for the last")
            if any(len(pair) != 2 or not all(isinstance(i, int) for i in pair) for pair in self.hidden_layers):
                raise ConfigError(f"hidden_layers={self.hidden_layers!r} must be (student, teacher) integer pairs")

    @property
    def matches_hidden_states(self) -> bool:
        return self.hidden_weight > 0

    @property
    def layer_pairs(self) -> list[tuple[int, int]]:
        return list(self.hidden_layers) if self.hidden_layers is not None else [(-1, -1)]

"""Sparsity patterns by name, and the checks every pruning entry point shares.

- `unstructured`: any weight may go; the fraction removed is the sparsity asked.
- `N:M` (`2:4`, `4:8`): in every run of M consecutive weights along a row (the input
  dimension, the layout of sparse tensor cores, arXiv 2104.08378), N are kept, so the sparsity
  is fixed at `1 - N/M`.
- `structured`: whole MLP neurons and attention heads go and the layers shrink
  (`quantlab.prune.structured`).
"""

import dataclasses
import re

from quantlab.errors import ConfigError, QuantlabError

STRUCTURED = "structured"
UNSTRUCTURED = "unstructured"
_NM = re.compile(r"^(\d+):(\d+)$")


class PruningError(QuantlabError, ValueError):
    """A layer cannot be pruned as asked (pattern that does not divide it, quantized layer)."""


@dataclasses.dataclass(frozen=True)
class SparsityPattern:
    """`kind` is "unstructured", "n:m" or "structured"; `n`/`m` are set for "n:m"."""

    kind: str
    n: int = 0
    m: int = 0

    @property
    def is_nm(self) -> bool:
        return self.kind == "n:m"

    @property
    def sparsity(self) -> float | None:
        """The sparsity the pattern fixes (N:M), or None when it is chosen freely."""
        return 1 - self.n / self.m if self.is_nm else None

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else self.kind


def parse_pattern(pattern: "str | SparsityPattern") -> SparsityPattern:
    """`"unstructured"`, `"structured"` or `"N:M"` with `0 < N < M` → a `SparsityPattern`."""
    if isinstance(pattern, SparsityPattern):
        return pattern
    text = str(pattern).strip().lower()
    if text in (UNSTRUCTURED, STRUCTURED):
        return SparsityPattern(text)
    match = _NM.match(text)
    if match is None:
        raise ConfigError(f"pattern {pattern!r} is not valid; use 'unstructured', 'structured', or N:M such as '2:4'")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise ConfigError(f"pattern {pattern!r}: an N:M pattern keeps N of every M weights, so it needs 0 < N < M")
    return SparsityPattern("n:m", n, m)


def check_sparsity(sparsity: float, name: str = "sparsity") -> float:
    """Sparsity is the fraction of weights removed: it must lie in [0, 1) (1 would remove everything)."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"{name}={sparsity!r} is not valid; give the fraction of weights to remove, in [0, 1)")
    return float(sparsity)


def resolve_sparsity(pattern: SparsityPattern, sparsity: float | None) -> float:
    """The sparsity a pattern prunes to: N:M fixes it (a different value is an error), others need one."""
    if pattern.is_nm:
        fixed = pattern.sparsity
        if sparsity is not None and abs(sparsity - fixed) > 1e-9:
            raise ConfigError(
                f"pattern {pattern} keeps {pattern.n} of every {pattern.m} weights, i.e. sparsity {fixed:g}; "
                f"drop sparsity={sparsity!r} or pass {fixed:g}"
            )
        return fixed
    if sparsity is None:
        raise ConfigError(f"pattern {pattern} needs a sparsity (the fraction of weights to remove, in [0, 1))")
    return check_sparsity(sparsity)

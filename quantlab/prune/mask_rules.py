"""Pruning masks as pure functions of importance scores: `True` keeps a weight, `False` removes it.

Magnitude pruning scores each weight by `|w|` (Han et al. 2015, "Learning both Weights and
Connections"; the baseline of Zhu & Gupta 2017). Masks remove exactly the number of weights
asked: ties at the threshold (frequent on weights that lie on a quantization grid, such as
SmolLM2's Q4_1 GGUF) are broken by position, so the sparsity reached is the sparsity asked.
"""

import torch

from quantlab.prune.patterns import PruningError


def pruned_count(numel: int, sparsity: float) -> int:
    """Weights removed from `numel` at `sparsity` (rounded to the nearest whole weight)."""
    return min(numel, max(0, round(numel * sparsity)))


def smallest_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """A mask of `scores`' shape that removes exactly the `k` lowest scores."""
    flat = scores.detach().reshape(-1)
    keep = torch.ones(flat.numel(), dtype=torch.bool, device=flat.device)
    if k <= 0:
        return keep.view(scores.shape)
    if k >= flat.numel():
        return torch.zeros_like(keep).view(scores.shape)
    threshold = torch.kthvalue(flat.float(), k).values
    below = flat < threshold
    keep &= ~below
    missing = k - int(below.sum())
    if missing > 0:  # ties at the threshold: remove the first `missing` of them
        ties = torch.nonzero(flat == threshold).squeeze(1)[:missing]
        keep[ties] = False
    return keep.view(scores.shape)


def magnitude_mask(weight: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Remove the `sparsity` fraction of `weight` with the smallest magnitude."""
    return smallest_k_mask(weight.detach().abs(), pruned_count(weight.numel(), sparsity))


def global_magnitude_masks(weights: dict[str, torch.Tensor], sparsity: float) -> dict[str, torch.Tensor]:
    """One magnitude threshold across all `weights`: layers with many small weights lose more.

    The scores are concatenated once (4 bytes per weight of extra memory), so a model's worth
    of layers costs one sort-free selection (`kthvalue`), not one per layer.
    """
    if not weights:
        return {}
    scores = torch.cat([w.detach().abs().float().reshape(-1) for w in weights.values()])
    keep = smallest_k_mask(scores, pruned_count(scores.numel(), sparsity))
    masks, start = {}, 0
    for name, weight in weights.items():
        masks[name] = keep[start : start + weight.numel()].view(weight.shape)
        start += weight.numel()
    return masks


def nm_mask(weight: torch.Tensor, n: int, m: int, layer: str = "weight") -> torch.Tensor:
    """Keep the `n` largest-magnitude weights of every `m` consecutive weights of each row."""
    out_features, in_features = weight.shape
    if in_features % m:
        raise PruningError(
            f"{layer}: {n}:{m} sparsity groups every {m} weights of a row, but the layer has "
            f"in_features={in_features}, which {m} does not divide; leave this layer out (modules=...) or "
            f"choose another pattern"
        )
    groups = weight.detach().abs().reshape(out_features, in_features // m, m)
    kept = torch.topk(groups, n, dim=-1, sorted=False).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, kept, True)
    return mask.view(out_features, in_features)


def follows_nm(mask: torch.Tensor, n: int, m: int) -> bool:
    """Whether every run of `m` weights along the rows keeps at most `n` (a valid N:M mask)."""
    out_features, in_features = mask.shape
    if in_features % m:
        return False
    return bool((mask.reshape(out_features, in_features // m, m).sum(-1) <= n).all())


def cubic_sparsity(step: int, initial: float, final: float, start: int, end: int, frequency: int = 1) -> float:
    """The gradual-pruning schedule of Zhu & Gupta 2017 ("To prune, or not to prune", arXiv 1710.01878).

    `s_t = s_f + (s_i - s_f) * (1 - (t - t0) / (n * dt))**3` for `t0 <= t <= t0 + n * dt`:
    pruning is fast at first, while redundant weights are plentiful, and slows as the final
    sparsity nears. `t` is rounded down to the last multiple of `frequency` (`dt`) after
    `start` (`t0`), the steps at which masks are recomputed. Before `start` the sparsity is
    `initial`, from `end` on it is `final`.
    """
    if end <= start:
        return final if step >= start else initial
    if step < start:
        return initial
    if step >= end:
        return final
    done = ((step - start) // frequency) * frequency
    progress = min(1.0, done / (end - start))
    return final + (initial - final) * (1.0 - progress) ** 3

"""Cutting a weight matrix into groups along its input dimension.

A `[out, in]` matrix becomes `[out, groups, group_size]`. When `group_size` does not divide
`in`, the last group of each row is padded by repeating the row's last weight, so the padding
never widens the group's range; `ungroup` drops it again.
"""

import torch


def num_groups(in_features: int, group_size: int | None) -> int:
    """Groups per row; `None` means one group spanning the row (per output channel)."""
    return 1 if group_size is None else -(-in_features // group_size)


def effective_group_size(in_features: int, group_size: int | None) -> int:
    return in_features if group_size is None else group_size


def group(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """`[out, in]` → `[out, groups, group_size]`, padding the last group if needed."""
    out_features, in_features = weight.shape
    size = effective_group_size(in_features, group_size)
    groups = num_groups(in_features, group_size)
    padding = groups * size - in_features
    if padding:
        weight = torch.cat([weight, weight[:, -1:].expand(out_features, padding)], dim=1)
    return weight.reshape(out_features, groups, size)


def ungroup(grouped: torch.Tensor, in_features: int) -> torch.Tensor:
    """`[out, groups, group_size]` → `[out, in]`, dropping padding."""
    return grouped.reshape(grouped.shape[0], -1)[:, :in_features]


def clipped_absmax(grouped: torch.Tensor, clip: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Each group's largest magnitude `[out, groups]` times `clip` (one ratio, or one per group): the
    scale of a table whose ends are -1 and 1 (NF4's, a learned one) with its range shrunk by `clip`."""
    clip = torch.as_tensor(clip, dtype=torch.float32, device=grouped.device)
    return grouped.float().abs().amax(dim=-1) * clip


def position_weights(in_features: int, group_size: int | None, channel_weights: torch.Tensor | None) -> torch.Tensor:
    """Weight of each grouped position `[1, groups, length]`: its input channel's weight (E[x_j^2] from
    calibration; 1 for every channel without data, or when all are 0), and 0 on the padding."""
    weights = torch.ones(in_features) if channel_weights is None else channel_weights.float().clamp(min=0)
    if weights.sum() <= 0:
        weights = torch.ones(in_features)
    groups, length = num_groups(in_features, group_size), effective_group_size(in_features, group_size)
    padded = torch.zeros(groups * length)
    padded[:in_features] = weights
    return padded.view(1, groups, length)

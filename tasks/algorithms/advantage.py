"""Group-relative advantages, as TRL's GRPOTrainer computes them.

    A_i = (r_i - mean(r_group)) / (std + 1e-4)

std is Bessel-corrected, taken per group (`scale_rewards="group"`), over the whole batch ("batch"), or
not at all ("none"). A completion whose every reward is missing (None) gets advantage 0 and does not
enter its group's statistics.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """rewards (N,) with NaN for missing, N = groups · group_size, grouped contiguously -> advantages (N,)."""
    grouped = rewards.view(-1, group_size)                                  # (G, n)
    present = ~torch.isnan(grouped)
    filled = torch.where(present, grouped, torch.zeros_like(grouped))
    count = present.sum(1, keepdim=True).clamp(min=1)
    mean = filled.sum(1, keepdim=True) / count                             # (G, 1)
    adv = torch.where(present, grouped - mean, torch.zeros_like(grouped))  # (G, n)
    if scale == "group":
        var = (adv ** 2).sum(1, keepdim=True) / (count - 1).clamp(min=1)
        adv = adv / (var.sqrt() + 1e-4)
    elif scale == "batch":
        flat = rewards[~torch.isnan(rewards)]
        std = flat.std() if flat.numel() > 1 else torch.tensor(0.0)
        adv = adv / (std + 1e-4)
    elif scale != "none":
        raise ValueError(f"scale_rewards: {scale!r}")
    return adv.reshape(-1)

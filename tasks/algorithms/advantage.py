"""Advantages from one scalar reward per completion (`train.learner.advantage`).

    group                  A_i = (r_i - mean(r_group)) / (std + 1e-4)         TRL's GRPOTrainer
    rloo                   A_i = r_i - mean(r_group without i)                 RLOO (leave-one-out baseline)
    reinforce_pp           A_i = (r_i - mean(r_batch)) / (std(r_batch) + 1e-4)  REINFORCE++ (batch whitening)
    reinforce_pp_baseline  a_i = r_i - mean(r_group), A_i = (a_i - mean(a)) / (std(a) + 1e-4) over the batch
                                                                               REINFORCE++-baseline

For `group`, std is Bessel-corrected, taken per group (`scale_rewards="group"`), over the whole batch
("batch"), or not at all ("none"); the REINFORCE++ stds are Bessel-corrected over the batch (OpenRLHF's
formulas). A completion whose every reward is missing (None: NaN here) gets advantage 0 and enters no mean,
no std and no baseline.
"""

from __future__ import annotations

import math

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """rewards (N,) with NaN for missing, N = groups · group_size, grouped contiguously -> advantages (N,). A group
    whose present rewards are all equal gets exactly 0 (its mean, rounded, is not always its value: eight 0.7s
    gave ±6e-4 after the division by a std of float noise, where TRL's formula gives the same)."""
    grouped = rewards.view(-1, group_size)                                  # (G, n)
    present = ~torch.isnan(grouped)
    filled = torch.where(present, grouped, torch.zeros_like(grouped))
    count = present.sum(1, keepdim=True).clamp(min=1)
    mean = filled.sum(1, keepdim=True) / count                             # (G, 1)
    adv = torch.where(present & ~_constant(grouped, present), grouped - mean, torch.zeros_like(grouped))  # (G, n)
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


def advantages(rewards: torch.Tensor, group_size: int, kind: str = "group", scale: str = "group") -> torch.Tensor:
    """rewards (N,) with NaN for missing, grouped contiguously -> advantages (N,) of `kind` (the module's table)."""
    if kind == "group":
        return group_advantages(rewards, group_size, scale)
    grouped = rewards.view(-1, group_size)
    present = ~torch.isnan(grouped)
    filled = torch.where(present, grouped, torch.zeros_like(grouped))
    count = present.sum(1, keepdim=True)
    if kind == "rloo":
        others = (count - 1).clamp(min=1)
        adv = torch.where(present & (count > 1) & ~_constant(grouped, present),
                          grouped - (filled.sum(1, keepdim=True) - filled) / others,
                          torch.zeros_like(grouped))
        return adv.reshape(-1)
    if kind == "reinforce_pp":
        centred = grouped
    elif kind == "reinforce_pp_baseline":
        centred = grouped - filled.sum(1, keepdim=True) / count.clamp(min=1)
    else:
        raise ValueError(f"advantage: {kind!r}")
    flat = centred[present]
    if flat.numel() == 0:
        return torch.zeros_like(rewards)
    std = flat.std() if flat.numel() > 1 else torch.tensor(0.0)
    adv = torch.where(present, (centred - flat.mean()) / (std + 1e-4), torch.zeros_like(grouped))
    return adv.reshape(-1)


def _constant(grouped: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """(G, 1): whether a group's present rewards are all the same value (exactly: the test is on the rewards, not
    on a std that float noise makes non-zero)."""
    hi = torch.where(present, grouped, torch.full_like(grouped, -math.inf)).amax(1, keepdim=True)
    lo = torch.where(present, grouped, torch.full_like(grouped, math.inf)).amin(1, keepdim=True)
    return hi == lo

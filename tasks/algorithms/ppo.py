"""PPO's value side (`train.algorithm: ppo`): token rewards, GAE, the clipped value loss, and the value head.
Pure functions over (B, T) tensors of completion tokens, `mask` 1 on the model's tokens; the formulas are
veRL's (verl/trainer/ppo/core_algos.py, 0.9): tests/test_ppo.py holds them equal on random inputs.

    r_t      = R on the episode's last model token (its scalar reward), 0 elsewhere,
               minus β·(log π_old - log π_ref) on every model token when the KL is in the reward
    δ_t      = r_t + γ·V(s_t') - V(s_t)           t' the next model token (environment tokens are skipped:
    A_t      = δ_t + γλ·A_t'                       their values and TD errors never enter, veRL's multi-turn GAE)
    G_t      = A_t + V(s_t)                        the critic's target, before whitening
    Â        = (A - mean_mask(A)) / sqrt(var_mask(A) + 1e-8)      over the whole batch (Bessel-corrected var)
    L_V      = ½ · max((V - G)², (clip(V, V_old ± c) - G)²), token mean over the batch

V(s_t) is the value of the state before token t: the value head on the hidden state whose logits predict t.
"""

from __future__ import annotations

import torch


def token_rewards(scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """scores (B,) with NaN for missing (reward 0 and no advantage: the row's mask should be 0), mask (B, T),
    kl (B, T) the per-token log π_old - log π_ref -> rewards (B, T)."""
    rewards = torch.zeros_like(mask)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values     # (B,)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] = torch.nan_to_num(scores[rows].to(rewards.dtype), nan=0.0)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (B, T), before whitening; tokens where mask is 0 carry the next model token's."""
    next_value = torch.zeros_like(values[:, 0])
    last = torch.zeros_like(values[:, 0])
    out = torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * last
        next_value = values[:, t] * m + (1 - m) * next_value
        last = here * m + (1 - m) * last
        out[:, t] = last
    return out, out + values


def whiten(values: torch.Tensor, mask: torch.Tensor, total: float, mean: float, sq_sum: float) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) with the batch's statistics (masked, Bessel-corrected): `total` the
    mask's sum over every micro-batch and process, `mean` the masked mean, `sq_sum` Σ mask·(v - mean)²."""
    var = sq_sum / max(total, 1.0) * (total / (total - 1) if total > 1 else 1.0)
    return (values - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=values.dtype, device=values.device))


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None, num_tokens: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's share of ½·token-mean over the batch of the clipped squared error (clip None: not
    clipped); and the clipped tokens' count."""
    err = (values - returns) ** 2
    if clip is None:
        return 0.5 * (err * mask).sum() / max(num_tokens, 1.0), torch.zeros((), device=values.device)
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    err_clipped = (clipped - returns) ** 2
    loss = torch.max(err, err_clipped)
    return 0.5 * (loss * mask).sum() / max(num_tokens, 1.0), ((err_clipped > err).float() * mask).sum()


class ValueHead(torch.nn.Module):
    """V(s) = w·h + b on a transformer's last hidden state h (float32, whatever the trunk's dtype)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.summary = torch.nn.Linear(hidden_size, 1, dtype=torch.float32)
        torch.nn.init.normal_(self.summary.weight, std=1.0 / (hidden_size + 1))
        torch.nn.init.zeros_(self.summary.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.summary(hidden.float()).squeeze(-1)

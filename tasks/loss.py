"""The GRPO clipped surrogate, as TRL's GRPOTrainer._compute_loss defines it. Pure: tensors in, loss out.

Per token t of completion i (A_i its advantage, r = π/π_old):
    ℓ_it = -min(r·A_i, clip(r, 1-ε, 1+ε_high)·A_i) + β·k3(π_ref ‖ π)
Aggregation by loss_type:
    dapo  Σ_it ℓ_it·m_it / Σ_it m_it             (token mean over the whole batch: long answers not diluted)
    grpo  mean_i (Σ_t ℓ_it·m_it / Σ_t m_it)      (per-sequence mean, then mean over sequences)
Callers split the batch into micro-batches and pass the *whole batch's* normaliser, so accumulated
gradients equal the full-batch gradient exactly.
"""

from __future__ import annotations

import torch


def per_token_loss(logp, old_logp, advantages, epsilon: float, epsilon_high: float | None,
                   ref_logp=None, beta: float = 0.0):
    """logp, old_logp, ref_logp: (B, T); advantages: (B,). Returns (loss (B, T), ratio (B, T), kl or None)."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logp - old_logp)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)
    adv = advantages.unsqueeze(1)
    loss = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1   # k3: unbiased, non-negative
        loss = loss + beta * kl
    return loss, ratio, kl


def aggregate(loss, mask, loss_type: str, num_tokens: float, num_sequences: int):
    """Reduce (B, T) per-token losses of a micro-batch to its share of the full-batch loss."""
    if loss_type == "dapo":
        return (loss * mask).sum() / max(num_tokens, 1.0)
    if loss_type == "grpo":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / num_sequences
    raise ValueError(f"loss_type: {loss_type!r}")


def clip_stats(ratio, advantages, mask, epsilon: float, epsilon_high: float | None) -> dict[str, float]:
    """Share of tokens where the clip was active, low side (A<0) and high side (A>0), as TRL logs them."""
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.unsqueeze(1)
    low = ((ratio < 1 - epsilon) & (adv < 0)).float()
    high = ((ratio > 1 + eps_high) & (adv > 0)).float()
    n = mask.sum().clamp(min=1.0)
    return {"clip_low_sum": float((low * mask).sum()), "clip_high_sum": float((high * mask).sum()),
            "tokens": float(n)}

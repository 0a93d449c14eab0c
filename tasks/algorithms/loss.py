"""The GRPO family of losses, as TRL's GRPOTrainer._compute_loss (TRL 1.16) defines them. Pure functions:
tensors and the train config in, loss and statistics out. tests/test_trl_parity.py checks them against TRL.

The settings are the learner's (train.learner: SurrogateConfig, `lc`), the KL's coefficient β is train.beta.
Per token t of completion i, with A_i its advantage and w the importance weight π/π_old — per token
(`importance_sampling_level: token`) or the geometric mean over the sequence (`sequence`, GSPO):
    grpo/dapo/bnpo/dr_grpo  ℓ = -min(w·A, clip(w, 1-ε, 1+ε_high)·A)      (w capped at δ first if `delta`)
    cispo                   ℓ = -sg(min(w, ε_high))·A·log π               (clips the weight, keeps the gradient)
    sapo                    ℓ = -σ(τ·(w-1))·4/τ·A                         (τ = τ_pos if A > 0 else τ_neg)
then ℓ ·= ρ (truncated importance weight π_old/μ against the generator's behaviour policy μ, if given), and
ℓ += β·k3(π_ref ‖ π) with k3 = exp(ref - logp) - (ref - logp) - 1, times w if `use_bias_correction_kl`.
Aggregation is over the *whole batch* (micro-batching is a memory knob, never a change of objective).
More: docs/internals.md (tasks/algorithms/loss.py): each loss type's aggregation, and where it departs from TRL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tasks.core.config_train import SurrogateConfig

CLIPPED_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")


def epsilon_high(lc: SurrogateConfig) -> float:
    """TRL's fallback: epsilon_high = epsilon. For cispo ε_high is a cap on the weight itself, not 1+ε, so
    the fallback would cap at 0.2; rlflow defaults it to 5.0, ScaleRL's recommendation (TRL's docs too)."""
    if lc.epsilon_high is not None:
        return lc.epsilon_high
    return 5.0 if lc.loss_type == "cispo" else lc.epsilon


def importance_weights(logp, old_logp, mask, level: str):
    """log w: (B, T) per token, or (B, 1) for the sequence (mean of token log-ratios over real tokens)."""
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        return ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    raise ValueError(f"importance_sampling_level: {level!r}")


def per_token_loss(logp, old_logp, advantages, mask, lc: SurrogateConfig, beta: float = 0.0, ref_logp=None,
                   is_ratio=None):
    """logp, old_logp, ref_logp, mask: (B, T); advantages: (B,); is_ratio: (B, T), (B, 1) or None; beta: the KL
    term's coefficient (train.beta; ref_logp needed when it is not 0).
    Returns (loss (B, T), w (B, T) or (B, 1), kl (B, T) or None)."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    coef_1 = torch.exp(importance_weights(logp, old_logp, mask, lc.importance_sampling_level))
    w = coef_1
    high = epsilon_high(lc)
    kl = None
    if beta != 0.0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
        if lc.use_bias_correction_kl:   # samples came from π_old: reweight so the KL gradient is unbiased
            kl = kl * coef_1
    if lc.loss_type == "cispo":
        loss = -torch.clamp(coef_1, max=high).detach() * adv * logp
    elif lc.loss_type in CLIPPED_TYPES:
        coef_2 = torch.clamp(coef_1, 1 - lc.epsilon, 1 + high)
        if lc.delta is not None:
            coef_1 = torch.clamp(coef_1, max=lc.delta)
        loss = -torch.min(coef_1 * adv, coef_2 * adv)
    elif lc.loss_type == "sapo":
        tau = torch.where(adv > 0, lc.sapo_temperature_pos, lc.sapo_temperature_neg)
        loss = -torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau * adv
    else:
        raise ValueError(f"loss_type: {lc.loss_type!r}")
    if is_ratio is not None:
        loss = loss * is_ratio
    if kl is not None:
        loss = loss + beta * kl
    return loss, w, kl


def aggregate(loss, mask, loss_type: str, num_tokens: float, num_sequences: int, max_completion_length: int):
    """A micro-batch's share of the full-batch loss (see the module docstring). loss, mask: (b, T)."""
    if loss_type in ("grpo", "sapo"):
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / num_sequences
    if loss_type in ("dapo", "bnpo", "cispo"):
        return (loss * mask).sum() / max(num_tokens, 1.0)
    if loss_type == "dr_grpo":
        return (loss * mask).sum() / (num_sequences * max_completion_length)
    raise ValueError(f"loss_type: {loss_type!r}")


def behaviour_correction(old_logp, behaviour_logp, mask, mode: str, cap: float):
    """Truncated importance sampling against the generator (TRL's vllm_importance_sampling_*):
    ρ = π_old/μ per token or per sequence; `*_truncate` caps it at `cap`, `*_mask` zeroes what exceeds it."""
    diff = torch.nan_to_num((old_logp - behaviour_logp) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=cap)
    if mode.endswith("mask"):
        return ratio.masked_fill(ratio > cap, 0.0)
    raise ValueError(f"importance_sampling_mode: {mode!r}")


def clip_stats(w, advantages, mask, lc: SurrogateConfig) -> dict[str, float]:
    """Token counts where the clip was active, low side (A<0) and high side (A>0), as TRL logs them."""
    adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    high = epsilon_high(lc)
    if lc.loss_type == "cispo":
        low_hit = torch.zeros_like(w, dtype=torch.bool)
        high_hit = (w > high) & (adv > 0)
    else:
        low_hit = (w < 1 - lc.epsilon) & (adv < 0)
        high_hit = (w > 1 + high) & (adv > 0)
    low = (low_hit.float().expand_as(mask) * mask).sum()
    hi = (high_hit.float().expand_as(mask) * mask).sum()
    return {"clip_low_sum": float(low), "clip_high_sum": float(hi)}

"""The V-trace + AWR learner (`train.algorithm: vtrace_awr`): off-policy value targets, an advantage-weighted
log-likelihood, and a KL constraint to the behaviour policy with a learned Lagrange multiplier. Pure
functions over (B, T) tensors of completion tokens, `mask` 1 on the model's tokens (environment tokens and
padding are skipped, as in GAE: tasks/algorithms/ppo.py).

V-trace (Espeholt et al. 2018, IMPALA), with log ρ_t = log π(a_t) - log μ(a_t) (π the learner before this
update, μ the policy that sampled, possibly K iterations older with replay):
    ρ_t = min(ρ̄, e^{log ρ_t}),   c_t = λ·min(c̄, e^{log ρ_t})
    δ_t = ρ_t·(r_t + γ·V(s_t') - V(s_t))                    t' the next model token (0 past the last)
    v_t = V(s_t) + δ_t + γ·c_t·(v_t' - V(s_t'))              the value target
    A_t = ρ_t·(r_t + γ·v_t' - V(s_t))                        the policy's advantage
AWR (Peng et al. 2019) weighs the policy's log-likelihood by exponentiated advantages; KL(μ‖π) is held near its
target by a learned Lagrange multiplier η (V-MPO's constraint, Song et al. 2019).
More: docs/internals.md (tasks/algorithms/vtrace.py): the AWR weights and the multiplier's loss.
"""

from __future__ import annotations

import torch


def vtrace(rewards: torch.Tensor, values: torch.Tensor, log_rho: torch.Tensor, mask: torch.Tensor, gamma: float,
           lam: float, rho_bar: float, c_bar: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) each -> value targets v (B, T) and policy advantages A (B, T); tokens where mask is 0 carry the
    next model token's and are never used."""
    ratio = torch.exp(log_rho)
    rho = torch.clamp(ratio, max=rho_bar)
    c = lam * torch.clamp(ratio, max=c_bar)
    zero = torch.zeros_like(values[:, 0])
    next_value, next_target, carried = zero, zero, zero      # V(s_t'), v_t', v_t' - V(s_t')
    targets, advantages = torch.zeros_like(values), torch.zeros_like(values)
    for t in range(values.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = rho[:, t] * (rewards[:, t] + gamma * next_value - values[:, t])
        here = delta + gamma * c[:, t] * carried
        target = values[:, t] + here
        advantages[:, t] = rho[:, t] * (rewards[:, t] + gamma * next_target - values[:, t])
        carried = here * m + (1 - m) * carried
        next_value = values[:, t] * m + (1 - m) * next_value
        next_target = target * m + (1 - m) * next_target
        targets[:, t] = next_target
    return targets, advantages


def awr_weights(advantages: torch.Tensor, temperature: float, max_weight: float) -> torch.Tensor:
    """w = min(exp(A / τ), w_max), computed without overflow (no gradient: the weights are targets)."""
    return torch.exp(torch.clamp(advantages.detach() / temperature, max=float(torch.log(torch.tensor(max_weight)))))


def kl_behaviour(logp: torch.Tensor, behaviour: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(μ‖π) per token on μ's samples: r - 1 - log r, r = π/μ (≥ 0, unbiased)."""
    log_r = logp - behaviour
    return torch.exp(log_r) - 1 - log_r


def lagrange_loss(eta_raw: torch.Tensor, kl: torch.Tensor, target: float) -> tuple[torch.Tensor, torch.Tensor]:
    """V-MPO's soft constraint: (the loss for the policy and the multiplier together, η)."""
    eta = torch.nn.functional.softplus(eta_raw)
    return eta.detach() * kl + eta * (target - kl.detach()), eta.detach()

"""One iteration's update: `train.num_iterations` optimiser passes over the scored batch, on any training
engine. Reads forward → loss → backward; the loss and the behaviour weight are tasks/algorithms/loss.py's, the
statistics tasks/algorithms/stats.py's. With num_iterations = 1 the update is on-policy: the ratio is
exp(logp - logp.detach()) = 1 and only the gradient flows (TRL does the same); with more, "old" logprobs are
computed once before the first pass and the later passes are clipped against them.

Samples of a policy S updates behind (run.max_staleness) are corrected by the behaviour weight π_old/μ: π_old is
the trainer's weights before this update (AReaL's proximal policy), μ the policy that sampled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tasks.algorithms.batching import MicroBatch
from tasks.algorithms.logprobs import completion_logprobs
from tasks.algorithms.loss import aggregate, behaviour_correction, per_token_loss
from tasks.algorithms.ppo import gae, token_rewards, value_loss, whiten
from tasks.algorithms.stats import UpdateStats
from tasks.algorithms.vtrace import awr_weights, kl_behaviour, lagrange_loss, vtrace

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.engines.training import TrainingEngine


def optimise(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config, iteration: int = 1) -> UpdateStats:
    """tc.num_iterations optimiser steps over the whole batch: gradients accumulated over micro-batches and
    processes, the loss normalised over the whole batch. Returns the statistics over all processes.

    train.algorithm: ppo: each micro-batch's `advantages` holds its rows' rewards on the way in; the critic's
    values turn them into per-token GAE advantages first (ppo_advantages), and every pass adds vf_coef times
    the clipped value loss, from the same forward (a value head) or the critic's own (a separate trunk).
    During train.critic_warmup iterations only the value loss is minimised."""
    tc, temperature = cfg.train, cfg.generate.temperature
    fixed_logprobs(engine, batches, cfg)
    ppo, awr = tc.algorithm == "ppo", tc.algorithm == "vtrace_awr"
    if ppo:
        ppo_advantages(engine, batches, cfg)       # (rows without a reward leave the loss: their mask is 0)
    if awr:
        vtrace_advantages(engine, batches, cfg)
    num_tokens, num_seqs = engine.sum([float(sum(b.mask.sum() for b in batches)), sum(b.rows for b in batches)])
    if awr:
        return _awr_passes(engine, batches, cfg, num_tokens)
    warm = ppo and iteration <= tc.critic_warmup
    policy_tc = tc.model_copy(update={"beta": 0.0}) if ppo and tc.kl_in_reward else tc
    stats = UpdateStats()
    for pass_ in range(tc.num_iterations):
        engine.zero_grad()
        stats.start_pass()
        for b in batches:
            if ppo:
                logp, entropy, hidden = completion_logprobs(engine.model, b.ids, b.attention, b.positions, b.width,
                                                            temperature, with_entropy=True, with_hidden=True,
                                                            share_prompts=b.share_prompts)
            else:
                logp, entropy = logprobs(engine.model, b, temperature, entropy=True)
            old = b.old if b.old is not None else logp.detach()   # on-policy: ratio 1, gradient only
            is_ratio = behaviour_weight(old, b, cfg) if tc.importance_sampling_correction else None
            ptl, ratio, kl = per_token_loss(logp, old, b.advantages, b.mask, policy_tc, ref_logp=b.ref,
                                            is_ratio=is_ratio)
            loss = aggregate(ptl, b.mask, tc.loss_type, num_tokens, int(num_seqs), completion_budget(cfg))
            if ppo:
                values = engine.critic.values(hidden, b, detach=warm)
                vloss, clipped = value_loss(values, b.values, b.returns, b.mask, tc.value_clip, num_tokens)
                stats.add_value(vloss, values, clipped, b, first_pass=pass_ == 0)
                loss = tc.vf_coef * vloss if warm else loss + tc.vf_coef * vloss
            engine.backward(loss)
            stats.add(b, loss, logp, entropy, ratio, kl, is_ratio, tc, first_pass=pass_ == 0)
        stats.grad_norm = engine.step()
    return stats.reduce(engine, num_tokens)


def _awr_passes(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config, num_tokens: float) -> UpdateStats:
    """vtrace_awr's passes: Σ w·log π (AWR) + the Lagrangian KL term + vf_coef · ½(V - v)², token means over the
    whole batch. The multiplier's `ε` term is split over micro-batches by their share of the tokens, so the
    accumulated loss is the full batch's."""
    tc, temperature = cfg.train, cfg.generate.temperature
    stats = UpdateStats()
    for pass_ in range(tc.num_iterations):
        engine.zero_grad()
        stats.start_pass()
        for b in batches:
            logp, entropy, hidden = completion_logprobs(engine.model, b.ids, b.attention, b.positions, b.width,
                                                        temperature, with_entropy=True, with_hidden=True,
                                                        share_prompts=b.share_prompts)
            weights = awr_weights(b.advantages, tc.awr_temperature, tc.awr_max_weight)
            policy = -(weights * logp * b.mask).sum() / max(num_tokens, 1.0)
            kl = (kl_behaviour(logp, b.behaviour) * b.mask).sum() / max(num_tokens, 1.0)
            share = float(b.mask.sum()) / max(num_tokens, 1.0)
            constraint, eta = lagrange_loss(engine.critic.eta, kl, tc.kl_target * share)
            values = engine.critic.values(hidden, b)
            vloss, clipped = value_loss(values, b.values, b.returns, b.mask, None, num_tokens)
            loss = policy + constraint + tc.vf_coef * vloss
            engine.backward(loss)
            ratio = torch.exp(logp.detach() - (b.old if b.old is not None else logp.detach()))
            stats.add(b, loss, logp, entropy, ratio, None, None, tc, first_pass=pass_ == 0)
            stats.add_value(vloss, values, clipped, b, first_pass=pass_ == 0)
            stats.add_awr(weights, kl, eta, b, first_pass=pass_ == 0)
        stats.grad_norm = engine.step()
    return stats.reduce(engine, num_tokens)


def vtrace_advantages(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config) -> None:
    """vtrace_awr, before the passes: one forward without gradients gives π_old's logprobs (log ρ against the
    behaviour's) and the value head's inputs, kept detached; `value_epochs` optimiser steps of the head alone
    on them fit V to its V-trace targets (no further forward of the model); then the targets and advantages
    with the fitted values, the advantages whitened over the whole batch (as ppo_advantages)."""
    tc, temperature = cfg.train, cfg.generate.temperature
    critic = engine.critic
    with torch.no_grad():
        for b in batches:
            old, hidden = _before_the_update(engine, b, temperature)
            b.encoded = critic.encode(hidden, b).detach()
            b.log_rho = (old - b.behaviour) * b.mask
            b.rewards = token_rewards(b.advantages, b.mask)
    num_tokens, = engine.sum([float(sum(b.mask.sum() for b in batches))])

    def targets(b: MicroBatch, values: torch.Tensor):
        return vtrace(b.rewards, values, b.log_rho, b.mask, tc.gamma, tc.lam, tc.rho_bar, tc.c_bar)

    for _ in range(tc.value_epochs):
        engine.zero_grad()
        loss = 0.0
        for b in batches:
            values = critic.head(b.encoded)
            with torch.no_grad():
                wanted, _ = targets(b, values)
            loss = loss + 0.5 * (((values - wanted) ** 2) * b.mask).sum() / max(num_tokens, 1.0)
        engine.critic_step(loss)
    with torch.no_grad():
        for b in batches:
            b.values = critic.head(b.encoded)
            b.returns, b.advantages = targets(b, b.values)
            b.encoded = None
        _whiten_over_batch(engine, batches)


def _before_the_update(engine: TrainingEngine, b: MicroBatch, temperature: float):
    """The value learners' forward without gradients: π_old's logprobs (b.old when the passes computed them)
    and the last hidden states (the critic's input); rows without a reward (NaN in `advantages`, which holds
    the rows' rewards here) leave the loss."""
    logp, _, hidden = completion_logprobs(engine.model, b.ids, b.attention, b.positions, b.width, temperature,
                                          with_hidden=True, share_prompts=b.share_prompts)
    b.mask = b.mask * (~torch.isnan(b.advantages)).to(b.mask.dtype).unsqueeze(1)
    return (b.old if b.old is not None else logp), hidden


def _whiten_over_batch(engine: TrainingEngine, batches: list[MicroBatch]) -> None:
    total, summed = engine.sum([float(sum(b.mask.sum() for b in batches)),
                                float(sum((b.advantages * b.mask).sum() for b in batches))])
    mean = summed / max(total, 1.0)
    squares, = engine.sum([float(sum((((b.advantages - mean) ** 2) * b.mask).sum() for b in batches))])
    for b in batches:
        b.advantages = whiten(b.advantages, b.mask, total, mean, squares)


def ppo_advantages(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config) -> None:
    """Per micro-batch, from its rows' rewards (in `advantages` on the way in): V_old from the critic, the token
    rewards (the reward on the last model token, minus β·(log π_old - log π_ref) per token with kl_in_reward),
    GAE's advantages and returns; then the advantages whitened with the whole batch's masked statistics (every
    micro-batch, every process). Environment tokens (mask 0) are skipped by GAE (tasks/algorithms/ppo.py)."""
    tc, temperature = cfg.train, cfg.generate.temperature
    with torch.no_grad():
        for b in batches:
            old, hidden = _before_the_update(engine, b, temperature)
            b.values = engine.critic.values(hidden, b)
            kl = (old - b.ref) if tc.kl_in_reward and b.ref is not None else None
            rewards = token_rewards(b.advantages, b.mask, kl, tc.beta)
            b.advantages, b.returns = gae(rewards, b.values, b.mask, tc.gamma, tc.lam)
        _whiten_over_batch(engine, batches)


def logprobs(model, b: MicroBatch, temperature: float, entropy: bool = False):
    """The completion tokens' logprobs under `model` (b, Lc), and their entropy (b, Lc) if asked for."""
    return completion_logprobs(model, b.ids, b.attention, b.positions, b.width, temperature, with_entropy=entropy,
                               share_prompts=b.share_prompts)


def fixed_logprobs(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config) -> None:
    """What stays fixed through the passes, computed once without gradients: the reference policy's logprobs
    (beta > 0; with LoRA the model with its adapter disabled) and, for several passes, π_old. With one pass
    π_old is the pass's own logprobs, detached (same weights, same inputs): no extra forward."""
    tc, temperature = cfg.train, cfg.generate.temperature
    with torch.no_grad():
        for b in batches:
            if engine.ref_model is not None:
                b.ref = logprobs(engine.ref_model, b, temperature)[0]
            elif tc.beta > 0 and engine.lora:
                with engine.model.disable_adapter():
                    b.ref = logprobs(engine.model, b, temperature)[0]
            if tc.num_iterations > 1:
                b.old = logprobs(engine.model, b, temperature)[0]


def behaviour_weight(old: torch.Tensor, b: MicroBatch, cfg: Config) -> torch.Tensor:
    """The weight π_old/μ against the generator's behaviour logprobs (tasks/algorithms/loss.py): truncated or
    masked as train.importance_sampling_mode says (tis), or AReaL's per token, masked above the cap (decoupled:
    π_old, the weights before this update, is its proximal policy)."""
    tc = cfg.train
    mode = "token_mask" if tc.off_policy_loss == "decoupled" else tc.importance_sampling_mode
    return behaviour_correction(old, b.behaviour, b.mask, mode, tc.importance_sampling_cap)


def completion_budget(cfg: Config) -> int:
    """dr_grpo's constant normaliser: the longest a completion can be (an episode's env.max_tokens, multi-turn)."""
    return cfg.env.max_tokens if cfg.env.factory else cfg.generate.max_completion_length

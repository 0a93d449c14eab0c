"""The V-trace + AWR learner (`train.algorithm: vtrace_awr`): it trains on this iteration's rollouts, the last
replay_iterations - 1 iterations' and any off-line ones (train.learner.offline_rollouts); before the passes, one
forward without gradients gives π_old's logprobs (log ρ against the behaviour's) and the value head's inputs, kept
detached, and value_epochs steps of the head alone fit V to its V-trace targets; each pass then minimises
Σ w·log π (AWR) + the Lagrangian KL term + vf_coef · ½(V - v)², token means over the whole batch. The formulas
are tasks/algorithms/vtrace.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tasks.algorithms.learners.value import ValueRows, ValueStats, before_the_update, value_metrics, whiten_over_batch
from tasks.algorithms.logprobs import Distribution
from tasks.algorithms.ppo import token_rewards, value_loss
from tasks.algorithms.vtrace import awr_weights, kl_behaviour, lagrange_loss, vtrace

if TYPE_CHECKING:
    from tasks.algorithms.stats import UpdateStats
    from tasks.core.config import Config
    from tasks.core.contracts import Forward, MicroBatch, Totals, TrainingEngine


@dataclass
class AwrStats(ValueStats):
    """The critic's side and the AWR weights' and KL constraint's."""

    kept = ("multiplier",)
    awr_weight_sum: float = 0.0     # first pass: the AWR weights summed over tokens
    kl_behaviour: float = 0.0       # first pass: KL(μ‖π) per token, the batch's mean
    multiplier: float = 0.0         # η, the KL constraint's Lagrange multiplier (the last micro-batch's)

    def add_awr(self, weights: torch.Tensor, kl: torch.Tensor, eta: torch.Tensor, b: MicroBatch,
                first_pass: bool) -> None:
        if first_pass:
            self.awr_weight_sum += float((weights * b.mask).sum())
            self.kl_behaviour += float(kl.detach())
            self.multiplier = float(eta)


class VtraceAwr:
    uses_hidden = True
    off_policy = True
    reports_kl_ref = True           # (its loss has no reference KL: train/kl_ref reads 0 with beta > 0, as before)
    behaviour_weighted = False      # (V-trace weighs by ρ itself)
    rows, stats, trains = ValueRows, AwrStats, ("critic",)

    def __init__(self, cfg: Config, iteration: int):
        self.cfg, self.settings = cfg, cfg.train.learner

    def replay(self, iteration: int) -> list[int]:
        return list(range(max(1, iteration - self.settings.replay_iterations + 1), iteration))

    def signal(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards                  # (per-token advantages from V-trace: prepare)

    def _targets(self, b: MicroBatch, values: torch.Tensor):
        lc = self.settings
        return vtrace(b.own.rewards, values, b.own.log_rho, b.mask, lc.gamma, lc.lam, lc.rho_bar, lc.c_bar)

    def prepare(self, engine: TrainingEngine, batches: list[MicroBatch]) -> None:
        """The forward without gradients, value pre-training on its detached states, then the targets and the
        advantages with the fitted values, whitened over the whole batch (as ppo's)."""
        critic = engine.critic
        with torch.no_grad():
            for b in batches:
                old, hidden = before_the_update(engine, b, Distribution.of(self.cfg))
                b.own = ValueRows(encoded=critic.encode(hidden, b).detach(), log_rho=(old - b.behaviour) * b.mask,
                                  rewards=token_rewards(b.signal, b.mask))
        num_tokens, = engine.sum([float(sum(b.mask.sum() for b in batches))])
        for _ in range(self.settings.value_epochs):
            engine.zero_grad()
            loss = 0.0
            for b in batches:
                values = critic.head(b.own.encoded)
                with torch.no_grad():
                    wanted, _ = self._targets(b, values)
                loss = loss + 0.5 * (((values - wanted) ** 2) * b.mask).sum() / max(num_tokens, 1.0)
            engine.critic_step(loss)
        with torch.no_grad():
            for b in batches:
                own = b.own
                own.values = critic.head(own.encoded)
                own.returns, b.advantages = self._targets(b, own.values)
                own.encoded = None
            whiten_over_batch(engine, batches)

    def loss(self, engine: TrainingEngine, b: MicroBatch, fwd: Forward, totals: Totals, stats: UpdateStats,
             first_pass: bool) -> torch.Tensor:
        """The multiplier's `ε` term is split over micro-batches by their share of the tokens, so the accumulated
        loss is the full batch's."""
        lc, num_tokens = self.settings, totals.num_tokens
        weights = awr_weights(b.advantages, lc.awr_temperature, lc.awr_max_weight)
        policy = -(weights * fwd.logp * b.mask).sum() / max(num_tokens, 1.0)
        kl = (kl_behaviour(fwd.logp, b.behaviour) * b.mask).sum() / max(num_tokens, 1.0)
        share = float(b.mask.sum()) / max(num_tokens, 1.0)
        constraint, eta = lagrange_loss(engine.critic.eta, kl, lc.kl_target * share)
        values = engine.critic.values(fwd.hidden, b)
        vloss, clipped = value_loss(values, b.own.values, b.own.returns, b.mask, None, num_tokens)
        loss = policy + constraint + lc.vf_coef * vloss
        ratio = torch.exp(fwd.logp.detach() - (b.old if b.old is not None else fwd.logp.detach()))
        stats.add(b, loss, fwd.logp, fwd.entropy, ratio, None, None, self.cfg.train, first_pass=first_pass)
        stats.own.add(vloss, values, clipped, b, first_pass=first_pass)
        stats.own.add_awr(weights, kl, eta, b, first_pass=first_pass)
        return loss

    def metrics(self, stats: UpdateStats, metrics: dict[str, float], denom: float) -> None:
        own = stats.own
        metrics.update({"train/awr_weight_mean": own.awr_weight_sum / denom,
                        "train/kl_behaviour": own.kl_behaviour, "train/kl_multiplier": own.multiplier})
        value_metrics(own, metrics, denom)

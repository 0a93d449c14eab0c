"""The PPO learner (`train.algorithm: ppo`): a value model (train.learner.critic; tasks/engines/critic.py) and
GAE turn each row's reward into per-token advantages, whitened over the whole batch; the policy loss is
loss_type's clipped surrogate (grpo.py: policy_loss), plus vf_coef times the clipped value loss from the same
forward (a value head) or the critic's own (a separate trunk). During train.learner.critic_warmup iterations only
the value loss is minimised. The formulas are tasks/algorithms/ppo.py's (veRL's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tasks.algorithms.learners.grpo import policy_loss
from tasks.algorithms.learners.value import ValueRows, ValueStats, before_the_update, value_metrics, whiten_over_batch
from tasks.algorithms.logprobs import Distribution
from tasks.algorithms.ppo import gae, token_rewards, value_loss

if TYPE_CHECKING:
    from tasks.algorithms.stats import UpdateStats
    from tasks.core.config import Config
    from tasks.core.contracts import Forward, MicroBatch, Totals, TrainingEngine


class Ppo:
    uses_hidden = True
    off_policy = False
    behaviour_weighted = True
    rows, stats, trains = ValueRows, ValueStats, ("critic",)

    def __init__(self, cfg: Config, iteration: int):
        self.cfg, self.settings = cfg, cfg.train.learner
        self.warm = iteration <= self.settings.critic_warmup          # the critic alone learns
        self.reports_kl_ref = not self.settings.kl_in_reward
        # with the KL in the reward, the policy's loss has none
        self.policy_beta = 0.0 if self.settings.kl_in_reward else cfg.train.beta

    def replay(self, iteration: int) -> list[int]:
        return []

    def signal(self, rewards: torch.Tensor) -> torch.Tensor:
        return rewards                  # (per-token advantages come from the critic's values: prepare)

    def prepare(self, engine: TrainingEngine, batches: list[MicroBatch]) -> None:
        """Per micro-batch, from its rows' rewards: V_old from the critic, the token rewards (the reward on the last
        model token, minus β·(log π_old - log π_ref) per token with kl_in_reward), GAE's advantages and returns;
        then the advantages whitened with the whole batch's masked statistics. Environment tokens (mask 0) are
        skipped by GAE (tasks/algorithms/ppo.py); rows without a reward leave the loss (their mask is 0)."""
        lc, beta = self.settings, self.cfg.train.beta
        with torch.no_grad():
            for b in batches:
                old, hidden = before_the_update(engine, b, Distribution.of(self.cfg))
                b.own = own = ValueRows(values=engine.critic.values(hidden, b))
                kl = (old - b.ref) if lc.kl_in_reward and b.ref is not None else None
                rewards = token_rewards(b.signal, b.mask, kl, beta)
                b.advantages, own.returns = gae(rewards, own.values, b.mask, lc.gamma, lc.lam)
            whiten_over_batch(engine, batches)

    def loss(self, engine: TrainingEngine, b: MicroBatch, fwd: Forward, totals: Totals, stats: UpdateStats,
             first_pass: bool) -> torch.Tensor:
        lc = self.settings
        loss, record = policy_loss(fwd, b, self.cfg, self.policy_beta, totals)
        values = engine.critic.values(fwd.hidden, b, detach=self.warm)
        vloss, clipped = value_loss(values, b.own.values, b.own.returns, b.mask, lc.value_clip, totals.num_tokens)
        stats.own.add(vloss, values, clipped, b, first_pass=first_pass)
        loss = lc.vf_coef * vloss if self.warm else loss + lc.vf_coef * vloss
        record(stats, loss, first_pass)
        return loss

    def metrics(self, stats: UpdateStats, metrics: dict[str, float], denom: float) -> None:
        value_metrics(stats.own, metrics, denom)

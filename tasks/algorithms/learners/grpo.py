"""The GRPO learner (`train.algorithm: grpo`, the default): one advantage per completion from the rewards alone
(train.learner.advantage: group-relative, RLOO, REINFORCE++; tasks/algorithms/advantage.py), and the GRPO family
of clipped surrogates (train.learner.loss_type; tasks/algorithms/loss.py), weighted by π_old/μ against the generator.

`policy_loss` is the surrogate for any per-row or per-token advantages: PPO's learner uses it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tasks.algorithms.advantage import advantages
from tasks.algorithms.loss import aggregate, behaviour_correction, per_token_loss

if TYPE_CHECKING:
    from tasks.algorithms.stats import UpdateStats
    from tasks.core.config import Config
    from tasks.core.contracts import Forward, MicroBatch, Totals, TrainingEngine


class Grpo:
    uses_hidden = False
    off_policy = False
    reports_kl_ref = True
    behaviour_weighted = True
    inert_at_zero = True            # a row of advantage 0 has loss 0 (with train.beta 0): update.py skips its backward
    rows = stats = None             # no fields, statistics or modules of its own
    trains = ()

    def __init__(self, cfg: Config, iteration: int):
        self.cfg, self.settings = cfg, cfg.train.learner

    def replay(self, iteration: int) -> list[int]:
        return []

    def signal(self, rewards: torch.Tensor) -> torch.Tensor:
        """The advantages (N,): the group statistics need the whole batch, so they are made before it is split."""
        return advantages(rewards, self.cfg.generate.num_generations, self.settings.advantage,
                          self.settings.scale_rewards)

    def prepare(self, engine: TrainingEngine, batches: list[MicroBatch]) -> None:
        for b in batches:
            b.advantages = b.signal

    def loss(self, engine: TrainingEngine, b: MicroBatch, fwd: Forward, totals: Totals, stats: UpdateStats,
             first_pass: bool) -> torch.Tensor:
        loss, record = policy_loss(fwd, b, self.cfg, self.cfg.train.beta, totals)
        record(stats, loss, first_pass)
        return loss

    def metrics(self, stats: UpdateStats, metrics: dict[str, float], denom: float) -> None:
        pass


def policy_loss(fwd: Forward, b: MicroBatch, cfg: Config, beta: float, totals: Totals):
    """The micro-batch's share of train.learner.loss_type's surrogate over the whole batch (`beta`: the KL term's
    coefficient, train.beta; ppo's with kl_in_reward has 0), and a function that records its statistics once the
    caller's loss is known: record(stats, loss, first_pass)."""
    lc = cfg.train.learner
    old = b.old if b.old is not None else fwd.logp.detach()    # on-policy: ratio 1, gradient only
    is_ratio = behaviour_weight(old, b, cfg) if cfg.train.importance_sampling_correction else None
    ptl, ratio, kl = per_token_loss(fwd.logp, old, b.advantages, b.mask, lc, beta, ref_logp=b.ref, is_ratio=is_ratio)
    loss = aggregate(ptl, b.mask, lc.loss_type, totals.num_tokens, totals.num_sequences, completion_budget(cfg))

    def record(stats: UpdateStats, total: torch.Tensor, first_pass: bool) -> None:
        stats.add(b, total, fwd.logp, fwd.entropy, ratio, kl, is_ratio, cfg.train, first_pass=first_pass,
                  surrogate=lc)
    return loss, record


def behaviour_weight(old: torch.Tensor, b: MicroBatch, cfg: Config) -> torch.Tensor:
    """The weight π_old/μ against the generator's behaviour logprobs (tasks/algorithms/loss.py): truncated or
    masked as train.importance_sampling_mode says (tis), or AReaL's per token, masked above the cap (decoupled:
    π_old, the weights before this update, is its proximal policy)."""
    tc = cfg.train
    mode = "token_mask" if tc.off_policy_loss == "decoupled" else tc.importance_sampling_mode
    return behaviour_correction(old, b.behaviour, b.mask, mode, tc.importance_sampling_cap)


def completion_budget(cfg: Config) -> int:
    """dr_grpo's constant normaliser: the longest a completion can be (an episode's env.max_tokens, multi-turn)."""
    return cfg.env.max_tokens if cfg.env.episodic() else cfg.generate.max_completion_length

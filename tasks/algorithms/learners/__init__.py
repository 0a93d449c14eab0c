"""The learners `train.algorithm` selects: each owns what it trains on (its inputs: which iterations' rollouts,
what it makes of their rewards), its preparation before the optimiser passes (advantages, values, value
pre-training) and its loss; its settings are its own section of the config (train.learner, tasks/core/config.py).

    grpo.py        advantages from the rewards alone (train.learner.advantage: group, RLOO, REINFORCE++)
    ppo.py         a value model, GAE's per-token advantages, the clipped surrogate + the value loss
    vtrace_awr.py  replay, V-trace's targets, an advantage-weighted log-likelihood, a learned KL constraint

The update loop (tasks/algorithms/update.py: optimise) is the same for all of them and never asks which one
runs; the train stage (tasks/engines/training.py: update) loads the rollouts a learner asks for from the store.
This module holds what they share (the Learner contract, a forward's outputs, the batch's totals) and imports
none of them; registry.py maps train.algorithm to its learner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tasks.algorithms.batching import MicroBatch
    from tasks.algorithms.stats import UpdateStats
    from tasks.engines.training import TrainingEngine


@dataclass
class Forward:
    """One micro-batch's forward in a pass, with gradients: what every learner's loss starts from."""

    logp: torch.Tensor                  # (b, Lc) the completion tokens' logprobs under the policy
    entropy: torch.Tensor               # (b, Lc)
    hidden: torch.Tensor | None         # (b, Lc, H) the last hidden states (a value model's input), if asked for


@dataclass
class Totals:
    """The whole batch's counts, over every micro-batch and process: the losses' normalisers."""

    num_tokens: float                   # completion tokens in the loss
    num_sequences: int


class Learner(Protocol):
    """One algorithm's side of an update; made for one iteration by registry.make(cfg, iteration)."""

    uses_hidden: bool        # the passes' forward also returns the last hidden states (a value model's input)
    off_policy: bool         # trains on replayed and off-line rows too (train/rows reports how many)
    reports_kl_ref: bool     # train/kl_ref with train.beta > 0 (ppo's KL in the reward: not a loss term)
    behaviour_weighted: bool     # the loss is weighted by π_old/μ (train.importance_sampling_correction)

    def replay(self, iteration: int) -> list[int]:
        """The earlier iterations whose scored rollouts this update trains on too (loaded by the engines side,
        with the section's off-line ones before them: train.learner.offline())."""

    def scores(self, rewards: torch.Tensor) -> torch.Tensor:
        """What the learner makes of the rows' rewards (N,) (NaN: none) before the batch is split: one value per
        row, carried by MicroBatch.scores (GRPO's advantages need the whole batch's groups)."""

    def prepare(self, engine: TrainingEngine, batches: list[MicroBatch]) -> None:
        """Before the passes, after the fixed logprobs (reference, π_old): each micro-batch's `advantages`, and
        whatever else the loss reads (values, returns)."""

    def loss(self, engine: TrainingEngine, b: MicroBatch, fwd: Forward, totals: Totals, stats: UpdateStats,
             first_pass: bool) -> torch.Tensor:
        """The micro-batch's share of the whole batch's loss (its statistics recorded in `stats`)."""

    def metrics(self, stats: UpdateStats, metrics: dict[str, float], denom: float) -> None:
        """The learner's own train/* metrics, added to `metrics` (denom: the batch's tokens, at least 1)."""

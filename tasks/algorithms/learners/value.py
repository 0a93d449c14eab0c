"""What the learners with a value model (ppo, vtrace_awr) share: their fields on each micro-batch (ValueRows) and
their statistics (ValueStats); before the passes, the forward without gradients that gives π_old's logprobs and
the critic's input, and the advantages' whitening over the whole batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tasks.algorithms.logprobs import Distribution, completion_logprobs
from tasks.algorithms.ppo import whiten
from tasks.algorithms.stats import LearnerStats

if TYPE_CHECKING:
    from tasks.core.contracts import MicroBatch, TrainingEngine


@dataclass
class ValueRows:
    """A value learner's fields on one micro-batch (MicroBatch.own), set before the passes."""

    values: torch.Tensor | None = None     # (b, Lc) the critic's values before the update (V_old)
    returns: torch.Tensor | None = None    # (b, Lc) the critic's targets: GAE's returns (ppo), V-trace's v (vtrace_awr)
    rewards: torch.Tensor | None = None    # (b, Lc) vtrace_awr: the token rewards
    log_rho: torch.Tensor | None = None    # (b, Lc) vtrace_awr: log π_old - log μ on the model's tokens
    encoded: torch.Tensor | None = None    # (b, Lc, H) vtrace_awr: the value head's detached inputs (until prepared)


@dataclass
class ValueStats(LearnerStats):
    """The critic's side of an update."""

    per_pass = ("value_loss", "value_clipped")
    value_loss: float = 0.0         # the last pass: the value loss (½ token mean of the clipped error)
    value_clipped: float = 0.0      # ppo, the last pass: tokens where the clipped error was the larger
    value_sum: float = 0.0          # first pass: the critic's values summed over tokens
    return_sum: float = 0.0         # the targets summed over tokens
    value_error: float = 0.0        # first pass: Σ (V - G)², for the explained variance
    return_sq: float = 0.0          # Σ G² (with return_sum: the targets' variance)

    def add(self, loss: torch.Tensor, values: torch.Tensor, clipped: torch.Tensor, b: MicroBatch,
            first_pass: bool) -> None:
        """One micro-batch's value side: its share of the value loss, its values (B, T), the clipped count."""
        self.value_loss += float(loss.detach())
        self.value_clipped += float(clipped)
        if first_pass:
            m, v, g = b.mask, values.detach(), b.own.returns
            self.value_sum += float((v * m).sum())
            self.return_sum += float((g * m).sum())
            self.value_error += float((((v - g) ** 2) * m).sum())
            self.return_sq += float(((g ** 2) * m).sum())


def before_the_update(engine: TrainingEngine, b: MicroBatch, temperature: float | Distribution):
    """The value learners' forward without gradients: π_old's logprobs (b.old when the passes computed them)
    and the last hidden states (the critic's input); rows without a reward (NaN in `signal`, the rows'
    rewards) leave the loss."""
    logp, _, hidden = completion_logprobs(engine.model, b.ids, b.attention, b.positions, b.width,
                                          Distribution.at(temperature, b), with_hidden=True,
                                          share_prompts=b.share_prompts)
    b.mask = b.mask * (~torch.isnan(b.signal)).to(b.mask.dtype).unsqueeze(1)
    return (b.old if b.old is not None else logp), hidden


def whiten_over_batch(engine: TrainingEngine, batches: list[MicroBatch]) -> None:
    """Each micro-batch's per-token advantages whitened with the whole batch's masked statistics (every
    micro-batch, every process)."""
    total, summed = engine.sum([float(sum(b.mask.sum() for b in batches)),
                                float(sum((b.advantages * b.mask).sum() for b in batches))])
    mean = summed / max(total, 1.0)
    squares, = engine.sum([float(sum((((b.advantages - mean) ** 2) * b.mask).sum() for b in batches))])
    for b in batches:
        b.advantages = whiten(b.advantages, b.mask, total, mean, squares)


def value_metrics(stats: ValueStats, metrics: dict[str, float], denom: float) -> None:
    """The critic's train/* metrics (advantage_std goes: whitened per token, it is 1 by construction)."""
    del metrics["train/advantage_std"]
    var = stats.return_sq / denom - (stats.return_sum / denom) ** 2
    metrics.update({"train/value_loss": stats.value_loss, "train/value_mean": stats.value_sum / denom,
                    "train/return_mean": stats.return_sum / denom,
                    "train/value_clipped": stats.value_clipped / denom,
                    # 1 - Var(G - V) / Var(G) as a mean squared error: 1 a perfect critic, 0 a constant
                    "train/explained_variance": 1.0 - (stats.value_error / denom) / var if var > 1e-12 else 0.0})

"""What an update did, as TRL's GRPOTrainer logs it: loss, grad norm, entropy, clip shares, importance ratios,
KL to the reference, and the generator/trainer mismatch. Sums over tokens are kept while the micro-batches
run and reduced over processes once at the end; `metrics` turns them into per-token means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from tasks.algorithms.loss import clip_stats

if TYPE_CHECKING:
    from tasks.core.config import SurrogateConfig, TrainConfig
    from tasks.core.contracts import MicroBatch


class Reducer(Protocol):
    """Element-wise reductions over the training processes (a training engine; identity with one process)."""

    def sum(self, values: list[float]) -> list[float]: ...
    def max(self, values: list[float]) -> list[float]: ...
    def min(self, values: list[float]) -> list[float]: ...


class LearnerMetrics(Protocol):
    """What `metrics` asks of the learner (tasks/algorithms/learners/: Learner)."""

    reports_kl_ref: bool
    behaviour_weighted: bool

    def metrics(self, stats: UpdateStats, metrics: dict[str, float], denom: float) -> None: ...


@dataclass
class LearnerStats:
    """A learner's own statistics (Learner.stats names its subclass): float fields, each summed over the processes
    at the end unless named in `kept` (a value the last micro-batch set); those in `per_pass` restart at each
    pass (the last pass's are reported)."""

    kept: ClassVar[tuple[str, ...]] = ()
    per_pass: ClassVar[tuple[str, ...]] = ()

    def start_pass(self) -> None:
        for name in self.per_pass:
            setattr(self, name, 0.0)

    def summed(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in self.kept]


@dataclass
class UpdateStats:
    loss: float = 0.0               # the last pass's loss (this process's share until reduced)
    grad_norm: float = 0.0          # the last pass's gradient norm, before clipping (over all processes)
    clip_low_sum: float = 0.0       # the last pass: tokens where the clip was active, A < 0
    clip_high_sum: float = 0.0      # the last pass: tokens where the clip was active, A > 0
    ratio_sum: float = 0.0          # every pass: π/π_old summed over tokens
    ratio_max: float = 0.0
    ratio_min: float = math.inf
    entropy: float = 0.0            # first pass, summed over tokens
    mismatch_kl: float = 0.0        # first pass: k3 KL(generator ‖ trainer) on the generator's samples
    mismatch_ratio: float = 0.0     # first pass: π/μ, the trainer's probability over the generator's, summed
    mismatch_outside: float = 0.0   # first pass: tokens whose π/μ lies outside [0.9, 1.1]
    kl_ref: float = 0.0             # first pass: the loss's KL term to the reference (beta > 0)
    is_ratio_sum: float = 0.0       # first pass: the behaviour importance weight π_old/μ
    is_ratio_min: float = math.inf
    is_capped_sum: float = 0.0      # first pass: tokens whose behaviour weight hit the cap (truncated or masked)
    num_tokens: float = 0.0         # tokens in the loss, over all processes
    own: LearnerStats | None = None     # the learner's own statistics (Learner.stats), reduced with these

    def start_pass(self) -> None:
        self.loss, self.clip_low_sum, self.clip_high_sum = 0.0, 0.0, 0.0
        if self.own is not None:
            self.own.start_pass()

    def add(self, b: MicroBatch, loss: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor,
            ratio: torch.Tensor, kl: torch.Tensor | None, is_ratio: torch.Tensor | None, tc: TrainConfig,
            first_pass: bool, surrogate: SurrogateConfig | None = None) -> None:
        """One micro-batch's forward: its aggregated loss, its logprobs (B, T) and entropy (B, T), the
        importance weight (B, T) or (B, 1), the KL term (B, T) and the behaviour weight. The clip shares are
        those of `surrogate`'s clip (the learner's settings; None: a learner without a clip counts none)."""
        m = b.mask
        self.loss += float(loss.detach())
        if surrogate is not None:
            clip = clip_stats(ratio.detach(), b.advantages, m, surrogate)
            self.clip_low_sum += clip["clip_low_sum"]
            self.clip_high_sum += clip["clip_high_sum"]
        if first_pass:
            self.entropy += float((entropy.detach() * m).sum())
            # KL(generator ‖ trainer) on the generator's own samples, k3 with r = π/μ; on pass 0 the trainer holds
            # the weights the generator sampled with plus run.max_staleness updates: with S = 0 this measures
            # engine/numerics mismatch alone, with S > 0 also how far S updates moved the policy.
            d = (logp.detach() - b.behaviour).double()       # (float64, expm1: k3 of a 1e-5 gap is ~5e-11,
            r = torch.exp(d)                                  # which exp(d) - d - 1 in float32 rounds to 0)
            self.mismatch_kl += float(((torch.expm1(d) - d) * m).sum())
            self.mismatch_ratio += float((r * m).sum())
            self.mismatch_outside += float((((r < 0.9) | (r > 1.1)) * m).sum())
            if kl is not None:
                self.kl_ref += float((kl.detach() * m).sum())
            if is_ratio is not None:
                rho = is_ratio.expand_as(m)[m.bool()]
                if rho.numel():
                    self.is_ratio_sum += float(rho.sum())
                    self.is_ratio_min = min(self.is_ratio_min, float(rho.min()))
                    # truncated: exactly the cap; masked: exactly 0 (an exp is never 0 otherwise)
                    self.is_capped_sum += float(((rho >= tc.importance_sampling_cap) | (rho == 0)).sum())
        real = ratio.detach().expand_as(m)[m.bool()]
        self.ratio_sum += float(real.sum())
        if real.numel():
            self.ratio_max = max(self.ratio_max, float(real.max()))
            self.ratio_min = min(self.ratio_min, float(real.min()))

    def reduce(self, over: Reducer, num_tokens: float) -> UpdateStats:
        """Sums, maxima and minima over every process."""
        summed = ("loss", "kl_ref", "mismatch_kl", "mismatch_ratio", "mismatch_outside", "entropy", "clip_low_sum",
                  "clip_high_sum", "ratio_sum", "is_ratio_sum", "is_capped_sum")
        own = self.own.summed() if self.own is not None else ()
        values = over.sum([getattr(self, k) for k in summed] + [getattr(self.own, k) for k in own])
        for name, value in zip(summed, values[:len(summed)]):
            setattr(self, name, value)
        for name, value in zip(own, values[len(summed):]):
            setattr(self.own, name, value)
        self.ratio_max, = over.max([self.ratio_max])
        self.ratio_min, self.is_ratio_min = over.min([self.ratio_min, self.is_ratio_min])
        self.num_tokens = num_tokens
        return self

    def metrics(self, rewards: torch.Tensor, advantages: torch.Tensor, tc: TrainConfig, seconds: float,
                learner: LearnerMetrics | None = None) -> dict:
        """The train/* metrics of an iteration: rewards (N,) with NaN for missing, advantages (N,) (the rows'
        signal), and the learner's own (tasks/algorithms/learners/; None: one with none, as grpo)."""
        present = rewards[~torch.isnan(rewards)]
        denom = max(self.num_tokens, 1.0)   # every completion may be masked (mask_truncated_completions)
        metrics = {
            "train/loss": self.loss,
            "train/grad_norm": self.grad_norm,
            "train/entropy": self.entropy / denom,
            "train/mismatch_kl": self.mismatch_kl / denom,
            "train/mismatch_ratio_mean": self.mismatch_ratio / denom if self.num_tokens else 1.0,
            "train/mismatch_ratio_outside": self.mismatch_outside / denom,     # share of tokens out of [0.9, 1.1]
            "train/clip_low": self.clip_low_sum / denom,
            "train/clip_high": self.clip_high_sum / denom,
            "train/clip_region": (self.clip_low_sum + self.clip_high_sum) / denom,   # TRL's region_mean
            "train/ratio_mean": self.ratio_sum / (denom * tc.num_iterations) if self.num_tokens else 1.0,
            "train/ratio_min": self.ratio_min if math.isfinite(self.ratio_min) else 1.0,
            "train/ratio_max": self.ratio_max,
            "train/advantage_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
            "train/reward_mean": float(present.mean()) if present.numel() else math.nan,     # (nothing scored)
            "train/tokens_per_s": self.num_tokens * tc.num_iterations / max(seconds, 1e-9),
            "train/seconds": seconds,
        }
        if learner is not None:
            learner.metrics(self, metrics, denom)
        if tc.beta > 0 and (learner is None or learner.reports_kl_ref):
            metrics["train/kl_ref"] = self.kl_ref / denom
        if tc.importance_sampling_correction and (learner is None or learner.behaviour_weighted):
            metrics["train/is_ratio_mean"] = self.is_ratio_sum / denom
            metrics["train/is_ratio_min"] = self.is_ratio_min if math.isfinite(self.is_ratio_min) else 1.0
            metrics["train/is_capped"] = self.is_capped_sum / denom     # share of tokens truncated or masked
        return metrics

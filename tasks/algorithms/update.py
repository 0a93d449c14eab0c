"""One iteration's update: `train.num_iterations` optimiser passes over the scored batch, on any training
engine, for any learner (tasks/algorithms/learners/: train.algorithm). Reads fixed logprobs → the learner's
preparation → per pass, per micro-batch: forward → the learner's loss → backward; one step per pass. The loop
never asks which learner runs. With num_iterations = 1 the update is on-policy: the ratio is
exp(logp - logp.detach()) = 1 and only the gradient flows (TRL does the same); with more, "old" logprobs are
computed once before the first pass and the later passes are clipped against them.

Samples of a policy S updates behind (run.max_staleness) are corrected by the behaviour weight π_old/μ: π_old is
the trainer's weights before this update (AReaL's proximal policy), μ the policy that sampled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tasks.algorithms.learners.registry import make
from tasks.algorithms.logprobs import Distribution, completion_logprobs
from tasks.algorithms.stats import UpdateStats
from tasks.core.contracts import Forward, MicroBatch, Totals

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Learner, TrainingEngine


def optimise(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config, iteration: int = 1,
             learner: Learner | None = None) -> UpdateStats:
    """tc.num_iterations optimiser steps over the whole batch: gradients accumulated over micro-batches and
    processes, the loss normalised over the whole batch. Returns the statistics over all processes. `batches`
    carry what `learner.signal` made of their rows' rewards (`learner`: train.algorithm's for `iteration`)."""
    tc, temperature = cfg.train, Distribution.of(cfg)
    learner = learner if learner is not None else make(cfg, iteration)
    fixed_logprobs(engine, batches, cfg)
    learner.prepare(engine, batches)          # (it may drop rows without a reward: their mask becomes 0)
    num_tokens, num_seqs = engine.sum([float(sum(b.mask.sum() for b in batches)), sum(b.rows for b in batches)])
    totals = Totals(num_tokens, int(num_seqs))
    stats = UpdateStats(own=learner.stats() if learner.stats is not None else None)
    for pass_ in range(tc.num_iterations):
        engine.zero_grad()
        stats.start_pass()
        for b in batches:
            out = completion_logprobs(engine.model, b.ids, b.attention, b.positions, b.width, temperature,
                                      with_entropy=True, with_hidden=learner.uses_hidden, share_prompts=b.share_prompts)
            fwd = Forward(out[0], out[1], out[2] if learner.uses_hidden else None)
            engine.backward(learner.loss(engine, b, fwd, totals, stats, first_pass=pass_ == 0))
        stats.grad_norm = engine.step()
    return stats.reduce(engine, num_tokens)


def logprobs(model, b: MicroBatch, temperature: float | Distribution, entropy: bool = False):
    """The completion tokens' logprobs under `model` (b, Lc), and their entropy (b, Lc) if asked for."""
    return completion_logprobs(model, b.ids, b.attention, b.positions, b.width, temperature, with_entropy=entropy,
                               share_prompts=b.share_prompts)


def fixed_logprobs(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config) -> None:
    """What stays fixed through the passes, computed once without gradients: the reference policy's logprobs
    (beta > 0; with LoRA the model with its adapter disabled) and, for several passes, π_old. With one pass
    π_old is the pass's own logprobs, detached (same weights, same inputs): no extra forward."""
    tc, temperature = cfg.train, Distribution.of(cfg)
    with torch.no_grad():
        for b in batches:
            if engine.ref_model is not None:
                b.ref = logprobs(engine.ref_model, b, temperature)[0]
            elif tc.beta > 0 and engine.lora:
                with engine.model.disable_adapter():
                    b.ref = logprobs(engine.model, b, temperature)[0]
            if tc.num_iterations > 1:
                b.old = logprobs(engine.model, b, temperature)[0]

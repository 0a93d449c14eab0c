"""One iteration's update: `train.num_iterations` optimiser passes over the scored batch, on any training
engine, for any learner (tasks/algorithms/learners/: train.algorithm). Reads fixed logprobs → the learner's
preparation → per pass, per micro-batch: forward → the learner's loss → backward; one step per pass. The loop
never asks which learner runs. With num_iterations = 1 the update is on-policy: the ratio is
exp(logp - logp.detach()) = 1 and only the gradient flows (TRL does the same); with more, "old" logprobs are
computed once before the first pass and the later passes are clipped against them.

Rows of advantage exactly 0 add nothing to a GRPO-family gradient with train.beta 0: on the torch engine they
run their forward without gradients (for the statistics), the loss keeps the whole batch's normalisers, so the
gradient is the same to rounding. More: docs/internals.md (tasks/algorithms/update.py).

Samples of a policy S updates behind (run.max_staleness) are corrected by the behaviour weight π_old/μ: π_old is
the trainer's weights before this update (AReaL's proximal policy), μ the policy that sampled.
"""

from __future__ import annotations

import dataclasses
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
    skip = _skips_inert(engine, learner, cfg)
    fixed_logprobs(engine, batches, cfg, old=not skip)
    learner.prepare(engine, batches)          # (it may drop rows without a reward: their mask becomes 0)
    num_tokens, num_seqs = engine.sum([float(sum(b.mask.sum() for b in batches)), sum(b.rows for b in batches)])
    totals = Totals(num_tokens, int(num_seqs))
    stats = UpdateStats(own=learner.stats() if learner.stats is not None else None)
    parts = [_split_inert(b) for b in batches] if skip else [(b, None) for b in batches]
    if parts and not any(live is not None for live, _ in parts):
        parts[-1] = (batches[-1], None)      # (no row to learn from: one backward of zeros, so the step is as before)
    if skip and tc.num_iterations > 1:       # π_old of the rows as the passes cut them: pass 0's ratio exactly 1
        with torch.no_grad():
            for part in (p for pair in parts for p in pair if p is not None):
                part.old = logprobs(engine.model, part, temperature)[0]
    for pass_ in range(tc.num_iterations):
        engine.zero_grad()
        stats.start_pass()
        for live, inert in parts:
            if live is not None:
                fwd = _forward(engine, live, learner, temperature)
                engine.backward(learner.loss(engine, live, fwd, totals, stats, first_pass=pass_ == 0))
            if inert is not None:
                with torch.no_grad():                 # (its statistics: entropy, mismatch, ratios)
                    learner.loss(engine, inert, _forward(engine, inert, learner, temperature), totals, stats,
                                 first_pass=pass_ == 0)
        stats.grad_norm = engine.step()
    return stats.reduce(engine, num_tokens)


def _forward(engine: TrainingEngine, b: MicroBatch, learner: Learner, temperature) -> Forward:
    out = completion_logprobs(engine.model, b.ids, b.attention, b.positions, b.width, Distribution.at(temperature, b),
                              with_entropy=True, with_hidden=learner.uses_hidden, share_prompts=b.share_prompts)
    return Forward(out[0], out[1], out[2] if learner.uses_hidden else None)


def _skips_inert(engine: TrainingEngine, learner: Learner, cfg: Config) -> bool:
    """Whether rows of advantage 0 may skip their backward: a learner whose loss is 0 at advantage 0 (its own class
    says so, `inert_at_zero`: a subclass that adds a term to the loss does not inherit it) with no fields or
    statistics of its own, no KL term (train.beta 0), an engine whose processes need not run the same backwards."""
    return (vars(type(learner)).get("inert_at_zero", False) and learner.rows is None and learner.stats is None
            and cfg.train.beta == 0 and getattr(engine, "partial_backward", False))


def _split_inert(b: MicroBatch) -> tuple[MicroBatch | None, MicroBatch | None]:
    """A micro-batch's rows that learn (advantage not 0, a token in the loss), and those whose loss is 0 but whose
    statistics count (advantage 0, a token in the loss); rows with no token in the loss are in neither. None for
    an empty side; the micro-batch itself where every row learns."""
    counted = b.mask.sum(-1) > 0
    learns = counted & b.advantages.reshape(b.advantages.shape[0], -1).ne(0).any(-1)
    if bool(learns.all()):
        return b, None
    return _rows(b, learns), _rows(b, counted & ~learns)


def _rows(b: MicroBatch, keep: torch.Tensor) -> MicroBatch | None:
    """The micro-batch of the rows `keep` marks: each of its tensors (one row per completion) cut alike."""
    if not bool(keep.any()):
        return None
    idx = keep.nonzero().squeeze(1)
    cut = {f.name: t.index_select(0, idx.to(t.device)) for f in dataclasses.fields(b)
           if isinstance(t := getattr(b, f.name), torch.Tensor)}
    return dataclasses.replace(b, **cut, rows=len(idx))


def logprobs(model, b: MicroBatch, temperature: float | Distribution, entropy: bool = False):
    """The completion tokens' logprobs under `model` (b, Lc), and their entropy (b, Lc) if asked for."""
    return completion_logprobs(model, b.ids, b.attention, b.positions, b.width, Distribution.at(temperature, b),
                               with_entropy=entropy, share_prompts=b.share_prompts)


def fixed_logprobs(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config, old: bool = True) -> None:
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
            if tc.num_iterations > 1 and old:
                b.old = logprobs(engine.model, b, temperature)[0]

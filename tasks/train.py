"""Stage 3 — train: one GRPO update on this iteration's scored rollouts.

    python -m tasks.train --config configs/tiny.yaml --iteration 3

Reads `<run>/iter-N/rewards` and the previous checkpoint (`<run>/trainer/ckpt-(N-1)`, or the base model for
N = 1); writes `<run>/trainer/ckpt-N` = model + optimizer state + RNG state + data cursor, then moves
`trainer/LATEST`. The loss and the advantages are the pure functions in tasks/algorithms/; this file only
batches, steps and saves.

The engine (`train.engine`, tasks/engines/training.py's factory: `torch`, one process on one device, or
`deepspeed`, ZeRO 1-3 over several processes, started here with torchrun when no torchrun started us) owns
the model, the optimizer and the checkpoint format. With several processes the advantages are computed over
the whole batch (groups complete), then each process takes a contiguous shard of the completions; the loss
is normalised by the whole batch's token/sequence counts, so the summed gradient is the single-process
whole-batch gradient.

With num_iterations = 1 the update is on-policy: the ratio is exp(logp - logp.detach()) = 1 and only the
gradient flows (TRL does the same). With num_iterations > 1, "old" logprobs are computed once before the
first pass and the later passes are clipped against them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.algorithms.advantage import group_advantages
from tasks.algorithms.batching import MicroBatch, shard_batches
from tasks.algorithms.logprobs import completion_logprobs
from tasks.algorithms.loss import aggregate, behaviour_correction, per_token_loss
from tasks.algorithms.stats import UpdateStats
from tasks.core import data, layout, rollout
from tasks.core.errors import UserError
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import open_store
from tasks.engines.training import TrainingEngine, training_engine

if TYPE_CHECKING:
    from tasks.core.config import Config


def train(cfg: Config, iteration: int) -> dict:
    """Update the policy on iteration `iteration`'s scored rollouts; returns {key, uri, metrics}."""
    store = open_store(cfg)
    run, tc = cfg.run.name, cfg.train
    key = layout.checkpoint(run, iteration)
    src = layout.rewards(run, iteration)
    src_manifest = require_input(store, src, iteration, "rewards", "reward")
    prev = layout.checkpoint(run, iteration - 1) if iteration > 1 else None
    prev_manifest = store.manifest(prev) if prev else None
    if prev and prev_manifest is None:
        raise UserError(f"iteration {iteration}: previous checkpoint {store.uri(prev)} is missing; train in order")
    fp = fingerprint(cfg, ("model", "train"), iteration=iteration,
                     rewards=src_manifest["files"][rollout.FILE]["sha256"],
                     previous=prev_manifest["files"][layout.CKPT_STATE]["sha256"] if prev_manifest else layout.BASE)
    if (done := reuse(store, key, fp)) is not None:
        if int(os.environ.get("RANK") or 0) == 0:
            store.advance_pointer(layout.latest(run, "trainer"), key)  # a kill may have come between the two
        return done
    Engine = training_engine(cfg)
    if Engine.launch(cfg, iteration):   # deepspeed without torchrun around us: the workers trained; read it back
        if (done := reuse(store, key, fp)) is None:
            raise RuntimeError(f"train[iter {iteration}]: the {tc.engine} workers exited 0 without writing "
                               f"{store.uri(key)}")
        return done

    t0 = time.perf_counter()
    engine = Engine.open(cfg, store, prev)
    try:
        with tempfile.TemporaryDirectory(prefix="rlflow-train-") as tmp:
            store.get_folder(src, Path(tmp))
            records = rollout.read(Path(tmp))
        rewards = torch.tensor([math.nan if r.reward is None else r.reward for r in records])
        advantages = group_advantages(rewards, cfg.generate.num_generations, tc.scale_rewards)   # (N,)

        batches = shard_batches(records, advantages, engine.tokenizer.pad_token_id, tc, engine.device,
                                engine.rank, engine.world_size)
        stats = optimise(engine, batches, cfg)
        engine.global_step += tc.num_iterations
        metrics = stats.metrics(rewards, advantages, tc, time.perf_counter() - t0)

        with tempfile.TemporaryDirectory(prefix="rlflow-ckpt-") as tmp:
            out = Path(tmp)
            extra = engine.save(out, iteration)          # every process: deepspeed gathers and saves shards
            if engine.rank == 0:                         # one writer
                (out / layout.CKPT_STATE).write_text(json.dumps({
                    "iteration": iteration, "step": engine.global_step,
                    "data_cursor": data.cursor(iteration + 1, cfg.generate.prompts_per_iteration), **extra}))
                manifest = store.put_folder(key, out, meta={"fingerprint": fp, "metrics": metrics,
                                                             "iteration": iteration})
                store.advance_pointer(layout.latest(run, "trainer"), key)
        engine.barrier()                                 # the others return once the checkpoint is complete
    finally:
        engine.close()
    return result(store, key, manifest) if engine.rank == 0 else reuse(store, key, fp)


def optimise(engine: TrainingEngine, batches: list[MicroBatch], cfg: Config) -> UpdateStats:
    """tc.num_iterations optimiser steps over the whole batch: gradients accumulated over micro-batches and
    processes, the loss normalised over the whole batch. Returns the statistics over all processes."""
    tc, temperature = cfg.train, cfg.generate.temperature
    num_tokens, num_seqs = engine.sum([float(sum(b.mask.sum() for b in batches)), sum(b.rows for b in batches)])
    fixed_logprobs(engine, batches, cfg)
    stats = UpdateStats()
    for pass_ in range(tc.num_iterations):
        engine.zero_grad()
        stats.start_pass()
        for b in batches:
            logp, entropy = logprobs(engine.model, b, temperature, entropy=True)
            old = b.old if b.old is not None else logp.detach()   # on-policy: ratio 1, gradient only
            is_ratio = behaviour_weight(old, b, cfg) if tc.importance_sampling_correction else None
            ptl, ratio, kl = per_token_loss(logp, old, b.advantages, b.mask, tc, ref_logp=b.ref, is_ratio=is_ratio)
            loss = aggregate(ptl, b.mask, tc.loss_type, num_tokens, int(num_seqs), cfg.generate.max_completion_length)
            engine.backward(loss)
            stats.add(b, loss, logp, entropy, ratio, kl, is_ratio, tc, first_pass=pass_ == 0)
        stats.grad_norm = engine.step()
    return stats.reduce(engine, num_tokens)


def logprobs(model, b: MicroBatch, temperature: float, entropy: bool = False):
    """The completion tokens' logprobs under `model` (b, Lc), and their entropy (b, Lc) if asked for."""
    return completion_logprobs(model, b.ids, b.attention, b.positions, b.width, temperature, with_entropy=entropy)


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
    """Truncated importance weight π_old/μ against the generator's behaviour logprobs (tasks/algorithms/loss.py)."""
    tc = cfg.train
    return behaviour_correction(old, b.behaviour, b.mask, tc.importance_sampling_mode, tc.importance_sampling_cap)


if __name__ == "__main__":
    stage_cli(train, "train")

"""Stage 3 — train: one GRPO update on this iteration's scored rollouts.

    python -m tasks.train --config configs/tiny.yaml --iteration 3 [--finish]

Reads `<run>/iter-N/rewards`; writes `<run>/trainer/ckpt-N`, then moves `trainer/LATEST`. The update itself
(advantages, micro-batches, the optimiser passes: tasks/algorithms/) runs on the engine `train.engine` names
(tasks/engines/training.py's factory: `torch`, one process on one device, or `deepspeed`, ZeRO 1-3 over
several processes, started here with torchrun when no torchrun started us).

`train.mode` says where the trainer lives:
  process   this stage's process: it restores the trainer from the newest full checkpoint (normally
            ckpt-(N-1); any iterations after it are replayed from their stored rewards), trains, and writes
            ckpt-N in full (model + optimizer + RNG + data cursor);
  resident  a trainer per run that outlives the stage (tasks/engines/resident.py), held by the calling process
            (train.host caller: the flow's own with the inline launcher) or a process of its own (detached:
            `python -m tasks.train` stages, deepspeed): the stage asks it "train iteration N"; it writes
            ckpt-N lean (the policy alone) and a full checkpoint every train.checkpoint_every iterations
            (deepspeed: a torchrun group of train.num_processes, its process 0 answering). `--finish` asks
            it for a full checkpoint of its last iteration and stops it (the flow does this when it ends).
Both give the same weights, bit for bit on a CPU.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from tasks.core import layout, rollout
from tasks.core.config import distributed_by_hand
from tasks.core.errors import UserError
from tasks.core.models import policy_dtype
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import open_store
from tasks.engines.training import restore, training_engine, update, write_checkpoint

if TYPE_CHECKING:
    from tasks.core.config import Config


def train(cfg: Config, iteration: int, finish: bool = False) -> dict:
    """Update the policy on iteration `iteration`'s scored rollouts; returns {key, uri, metrics}."""
    if finish:
        return finish_trainer(cfg)
    if cfg.resident_trainer and distributed_by_hand():   # (auto never picks resident there)
        raise UserError("train.mode: resident keeps one trainer (or one torchrun group) on one machine; on "
                        "several nodes or inside torchrun use train.mode process (or auto)")
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
                     previous=prev_manifest["files"][layout.CKPT_STATE]["sha256"] if prev_manifest else layout.BASE,
                     **({} if policy_dtype(cfg) == cfg.model.dtype else {"policy_dtype": policy_dtype(cfg)}))
    if (done := reuse(store, key, fp)) is not None:
        if int(os.environ.get("RANK") or 0) == 0:
            store.advance_pointer(layout.latest(run, "trainer"), key)  # a kill may have come between the two
        return done
    if cfg.resident_trainer:
        from tasks.engines.resident import resident_trainer

        resident_trainer(cfg).train(iteration, fp)
        if (done := reuse(store, key, fp)) is None:
            raise RuntimeError(f"train[iter {iteration}]: the resident trainer answered without writing "
                               f"{store.uri(key)}")
        return done
    if training_engine(cfg).launch(cfg, iteration):   # deepspeed, no torchrun around us: the workers trained
        if (done := reuse(store, key, fp)) is None:
            raise RuntimeError(f"train[iter {iteration}]: the {tc.engine} workers exited 0 without writing "
                               f"{store.uri(key)}")
        return done

    t0 = time.perf_counter()
    engine = restore(cfg, store, iteration - 1)
    restored = time.perf_counter() - t0
    try:
        metrics = update(engine, cfg, store, iteration, t0)
        metrics["train/restore_seconds"] = restored         # the full checkpoint read (and any replay)
        manifest = write_checkpoint(store, cfg, key, iteration, engine.global_step,
                                    lambda out: engine.save(out, iteration), {"fingerprint": fp, "metrics": metrics},
                                    rank=engine.rank)
        if engine.rank == 0:                             # one writer
            store.advance_pointer(layout.latest(run, "trainer"), key)
        engine.barrier()                                 # the others return once the checkpoint is complete
    finally:
        engine.close()
    return result(store, key, manifest) if engine.rank == 0 else reuse(store, key, fp)


def finish_trainer(cfg: Config) -> dict:
    """Stop the run's resident trainer on this machine, after a full checkpoint of its last iteration: the one
    this process holds (train.host caller) and a detached one (a flow's inline finish after local stages); with
    neither, the run's newest iteration still gets its full checkpoint if it lacks one."""
    if not cfg.resident_trainer:
        return {"finished": None}
    from tasks.engines.resident import CallerTrainer, ResidentTrainer, resident_trainer, unfinished

    held = CallerTrainer(cfg).finish()
    detached = ResidentTrainer(cfg).finish()
    if held is None and detached is None and unfinished(open_store(cfg), cfg.run.name) is not None:
        # Nothing runs, but the newest iteration lacks a full checkpoint (its trainer died after committing
        # it; this flow run reused it): one is made here, where train.host puts the trainer, by replay.
        return {"finished": resident_trainer(cfg).finish(catch_up=True)}
    return {"finished": held if held is not None else detached}


if __name__ == "__main__":
    stage_cli(train, "train", takes_finish=True)

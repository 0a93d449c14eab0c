"""Stage 3 — train: one update of the configured learner (train.algorithm) on this iteration's scored rollouts.

    python -m tasks.train --config configs/tiny.yaml --iteration 3
    python -m tasks.train finish --config configs/tiny.yaml --iteration 0    # the flow's end: finish_trainer

Reads `<run>/iter-N/rewards`; writes `<run>/trainer/ckpt-N`, then moves `trainer/LATEST`. The stage checks its
inputs and fingerprint, then asks the run's trainer (tasks/engines/trainer.py: Trainer, the one class that trains
an iteration) through a handle; the update itself (the learner, grpo, ppo or vtrace_awr:
tasks/algorithms/learners/; micro-batches and the optimiser passes: tasks/algorithms/update.py) runs on the
engine `train.engine` names (tasks/engines/training.py's factory: `torch` or `deepspeed`).
`train.mode` says where the trainer lives (open_trainer below): `process`, this stage's process, or `resident`,
a trainer per run that outlives the stage. Both give the same weights, bit for bit on a CPU.
More: docs/internals.md (tasks/train.py): the engines and both modes, in full.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from tasks.core import layout, rollout
from tasks.core.errors import UserError
from tasks.core.models import policy_dtype
from tasks.core.stage import by_hand, fingerprint, require_input, reuse, stage_cli
from tasks.core.store import open_store
from tasks.engines.detached import DetachedTrainer, GroupTrainer, node_layout
from tasks.engines.trainer import TRAIN_SECTIONS, InProcessTrainer, unfinished

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import TrainerHandle


def train(cfg: Config, iteration: int) -> dict:
    """Update the policy on iteration `iteration`'s scored rollouts; returns {key, uri, metrics}."""
    if cfg.resident_trainer and "RANK" in os.environ:    # (auto never picks resident there)
        raise UserError("train.mode: resident keeps one trainer (one torchrun group of its own, started by the "
                        "stage); inside a torchrun started by hand use train.mode process (or auto)")
    if cfg.resident_trainer and node_layout()[0] > 1 and cfg.train.engine != "deepspeed":
        raise UserError(f"train.mode: resident keeps one trainer of one process with train.engine torch, but "
                        f"NNODES={node_layout()[0]}; use train.engine=deepspeed (one resident group across the "
                        f"nodes) or one node")
    if cfg.train.engine == "torch":
        for var in ("WORLD_SIZE", "NNODES"):     # (several processes would each write the same checkpoint)
            if int(os.environ.get(var) or 1) > 1:
                raise UserError(f"train.engine: torch trains in one process on one device, but {var}="
                                f"{os.environ[var]}; use train.engine=deepspeed for several GPUs or nodes")
    store = open_store(cfg)
    run = cfg.run.name
    key = layout.checkpoint(run, iteration)
    if iteration > 1 and store.manifest(layout.checkpoint(run, iteration - 1)) is None and \
            (kept := _outlived_its_input(cfg, store, iteration)) is not None:
        return kept
    src_manifest = require_input(store, cfg, "train", iteration, ("reward", iteration))
    prev_manifest = require_input(store, cfg, "train", iteration, ("train", iteration - 1)) if iteration > 1 else None
    # (the trainer writes ckpt-N with the config part of `made`: TRAIN_SECTIONS, tasks/engines/trainer.py)
    fp, made = fingerprint(cfg, TRAIN_SECTIONS, iteration=iteration,
                           rewards=src_manifest["files"][rollout.FILE]["sha256"],
                           previous=prev_manifest["files"][layout.CKPT_STATE]["sha256"] if prev_manifest else
                           layout.BASE,
                           **({} if policy_dtype(cfg) == cfg.model.dtype else {"policy_dtype": policy_dtype(cfg)}))
    if (done := reuse(store, key, fp, made)) is not None:
        return _taken(store, run, key, done)
    handle = open_trainer(cfg)
    try:
        handle.train(iteration, fp)
    finally:
        handle.close()
    if (done := reuse(store, key, fp)) is None:
        raise RuntimeError(f"train[iter {iteration}]: the trainer ({type(handle).__name__}) answered without "
                           f"writing {store.uri(key)}")
    return done


def _outlived_its_input(cfg: Config, store, iteration: int) -> dict | None:
    """ckpt-N, complete and made from this config, where ckpt-(N-1) is gone: store.keep deletes all but the newest
    checkpoints as a run starts, while a resume walks again from the newest iteration MLflow has logged (its
    tracker flushes behind the store: a kill left v10 published and MLflow at 8, so train 9 asked for the deleted
    ckpt-8 and the run could never resume). Its fingerprint names ckpt-(N-1)'s hash, which cannot be read any more:
    it is taken on its config (the run's own chain, whose older links retention removed). None otherwise."""
    import json

    from tasks.core.stage import made_of, result

    key = layout.checkpoint(cfg.run.name, iteration)
    manifest, made = store.manifest(key), json.loads(json.dumps(made_of(cfg, TRAIN_SECTIONS)))   # (as stored)
    if manifest is None or manifest.get("meta", {}).get("made_of") != made:
        return None
    return _taken(store, cfg.run.name, key, result(store, key, manifest))


def _taken(store, run: str, key: str, done: dict) -> dict:
    """A stored ckpt-N taken as this stage's result (`done`), with trainer/LATEST moved to it by the first rank (a
    kill may have come between the checkpoint and the pointer)."""
    if int(os.environ.get("RANK") or 0) == 0:
        store.advance_pointer(layout.latest(run, "trainer"), key)
    return done


def open_trainer(cfg: Config) -> TrainerHandle:
    """The stage's handle on the run's trainer, where the config puts it: process mode, one of its own for this
    iteration (torch: in this process; deepspeed: a group of processes, GroupTrainer, or this process's part when
    a torchrun started by hand runs the stage in each of its processes); resident, the run's, held by this process
    (train.host caller) or in processes of its own (detached). host auto is caller for the torch engine, detached
    for deepspeed (a torchrun group); a stage process (`python -m tasks.train`) has made it detached already
    (stage_process)."""
    if not cfg.resident_trainer:
        if cfg.train.engine == "deepspeed" and "RANK" not in os.environ:
            return GroupTrainer(cfg)
        return InProcessTrainer(cfg, held=False)
    host = cfg.train.host
    if host == "auto":
        host = "detached" if cfg.train.engine == "deepspeed" else "caller"
    return InProcessTrainer(cfg) if host == "caller" else DetachedTrainer(cfg)


HAND_RUN_IDLE = 600.0    # s: train.idle_timeout of a detached trainer a stage typed by hand starts (unless set)


def stage_process(cfg: Config) -> Config:
    """What the train stage's own process (`python -m tasks.train`, which ends with the stage) makes of the config,
    once, at the process boundary (stage_cli): train.host auto becomes detached (a trainer held here would end
    with this process). Typed by hand (no launcher) nobody will finish that trainer, so it leaves after
    HAND_RUN_IDLE s unused instead of train.idle_timeout's default two hours: long enough for the next
    iteration's generate, reward and train typed by hand to find it warm (an idle_timeout set is kept)."""
    update: dict = {"host": "detached"} if cfg.train.host == "auto" else {}
    if by_hand() and "idle_timeout" not in cfg.train.model_fields_set:
        update["idle_timeout"] = HAND_RUN_IDLE
    return cfg.model_copy(update={"train": cfg.train.model_copy(update=update)}) if update else cfg


def finish_trainer(cfg: Config) -> int | None:
    """Stop the run's resident trainer on this machine, after a full checkpoint of its last iteration (whose
    iteration it returns; None: nothing to finish): the one this process holds (train.host caller) and a
    detached one (a flow's inline finish after local stages); with neither, the run's newest iteration still gets
    its full checkpoint if it lacks one. Process mode: nothing (each ckpt-N is full)."""
    if not cfg.resident_trainer:
        return None
    held = InProcessTrainer(cfg).finish()
    detached = DetachedTrainer(cfg).finish()
    if held is None and detached is None and unfinished(open_store(cfg), cfg.run.name) is not None:
        # Nothing runs, but the newest iteration lacks a full checkpoint (its trainer died after committing
        # it; this flow run reused it): one is made here, where train.host puts the trainer, by replay.
        return open_trainer(cfg).finish(catch_up=True)
    return held if held is not None else detached


def finish(cfg: Config, iteration: int = 0) -> dict:
    """`python -m tasks.train finish`: finish_trainer on this machine (the flow's end when the train stage runs
    on a cluster: sky/train.yaml's FINISH). {"finished": the iteration of the last full checkpoint, or None}"""
    return {"finished": finish_trainer(cfg)}


if __name__ == "__main__":
    if sys.argv[1:2] == ["finish"]:
        del sys.argv[1]
        stage_cli(finish, "train finish", own_process=stage_process)
    else:
        stage_cli(train, "train", own_process=stage_process)

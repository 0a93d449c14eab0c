"""The trainer: the one class that trains an iteration (restore and replay, update, checkpoint, trainer/LATEST),
and the in-process handle on it.

    handle = open_trainer(cfg)               # tasks/train.py: where train.mode, train.host and train.engine put it
    handle.preload(N - 1)                    # (the flow, while it generates N: restore now)
    handle.train(N, fingerprint)             # ckpt-N committed, trainer/LATEST moved
    handle.close()                           # the stage is done with it (process mode: the trainer goes)
    handle.finish()                          # the run is done: a full checkpoint of its last iteration, then it goes

A handle (TrainerHandle) is an InProcessTrainer (the trainer in this process), a GroupTrainer (a deepspeed group
for one iteration) or a DetachedTrainer (resident in processes of its own; both: tasks/engines/detached.py). All
run `Trainer` below, so a resident run and a process-mode run train with the same code and publish the same
weights (bit for bit on a CPU); what differs is what ckpt-N holds.
More: docs/internals.md (tasks/engines/trainer.py): the handles, and what each checkpoint holds.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.algorithms.batching import shard_batches
from tasks.algorithms.learners.registry import make as make_learner
from tasks.algorithms.stats import UpdateStats
from tasks.algorithms.update import optimise
from tasks.core import data, layout, rollout
from tasks.core.hashing import digest, sha256_file
from tasks.core.process_wide import PROCESS_WIDE, rng_state, set_rng_state
from tasks.core.stage import made_of
from tasks.core.store import open_store
from tasks.engines.training import episode_signal, newest_full, offline_rollouts, training_engine

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import TrainingEngine
    from tasks.core.store import Store


TRAIN_SECTIONS = ("model", "train")     # the config sections a checkpoint is made from (tasks/train.py's fingerprint)


def trainer_key(cfg: Config) -> str:
    """What a running trainer must have been started with to serve this config: everything but the sections
    that cannot change a trainer's result or its files (tracking, launcher, cost, eval), and where it runs
    (train.mode, train.host: a stage process asking with host auto finds the one a detached request started;
    train.idle_timeout: a stage typed by hand finds the flow's, and the flow a hand-run stage's)."""
    tree = cfg.model_dump(mode="json")
    for section in ("tracking", "launcher", "cost", "eval"):
        tree.pop(section)
    for field in ("mode", "host", "idle_timeout"):
        tree["train"].pop(field)
    return digest(tree)


# ------------------------------------------------------------------------------------------- the trainer

class Trainer:
    """The trainer's state between requests: the engine and the iteration its weights are at. `resident`: it
    outlives one iteration (lean ckpt-N, background full checkpoints, random streams of its own while it shares
    a process); else it trains one iteration and writes ckpt-N in full (process mode)."""

    def __init__(self, cfg: Config, store: Store, rank: int = 0, resident: bool = True):
        self.cfg, self.store, self.rank, self.resident = cfg, store, rank, resident
        self.engine: TrainingEngine | None = None
        self.at: int | None = None              # the iteration whose updated state the engine holds
        self.full_at: int | None = None         # the newest iteration with a full checkpoint, written or writing
        self.writer: threading.Thread | None = None
        self.writer_error: BaseException | None = None
        self.rng: dict | None = None            # the trainer's random streams between requests (see _own_rng)
        self.restored: float | None = None      # seconds the last restore took, until a train request reports it

    @contextlib.contextmanager
    def _own_rng(self):
        """Run with the trainer's own random streams and give the process back its own after: a trainer held by
        its caller shares the process with generate, which seeds the global torch RNG per request. Without the
        swap its dropout masks (and the RNG state a full checkpoint saves) would follow generate's seeds, and
        neither process mode nor a replay, which restore the trainer's saved streams, would give its weights.
        A process-mode trainer restores its saved streams on open and ends after one iteration: nothing to swap
        (and no lock held while it trains)."""
        if not self.resident:
            yield
            return
        with PROCESS_WIDE:         # (a model another thread builds meanwhile waits: tasks/core/models.py)
            outer = rng_state()
            if self.rng is not None:
                set_rng_state(self.rng)
            try:
                yield
            finally:
                self.rng = rng_state() if self.engine is not None else None
                set_rng_state(outer)

    def train(self, iteration: int, fingerprint: str) -> dict:
        with self._own_rng():
            return self._train(iteration, fingerprint)

    def preload(self, iteration: int) -> int:
        """Hold the state after `iteration` (restored and replayed now if not held already); a late request,
        for an iteration the trainer has trained past, changes nothing. Returns the iteration held."""
        if self.at is not None and self.at > iteration:
            return self.at
        with self._own_rng():
            self._restore_to(iteration)
        return iteration

    def _restore_to(self, iteration: int) -> None:
        if self.at == iteration:
            return
        t0 = time.perf_counter()
        self.close()
        self.engine = self.restore(iteration)
        self.at = iteration
        full = self.resident and newest_full(self.store, self.cfg.run.name, iteration)[1] == iteration
        self.full_at = iteration if full else None     # (process mode writes no full checkpoint but its ckpt-N)
        self.restored = time.perf_counter() - t0
        if iteration and self.resident:     # (a new run's trainer has nothing to restore: nothing to say)
            print(f"restored the state after iteration {iteration} in {self.restored:.2f} s", flush=True)

    def final_checkpoint(self) -> int | None:
        """A full checkpoint of the current iteration, written now (finish, idle exit). A trainer that holds
        nothing or an older iteration (new: its predecessor died after committing the run's last iterations, which
        this flow run reused) first restores the newest committed one when that has no full checkpoint, so a flow
        run still ends with one."""
        with self._own_rng():
            newest = unfinished(self.store, self.cfg.run.name)
            if newest is not None and (self.engine is None or (self.at or 0) < newest):
                self._restore_to(newest)     # (one held behind it too: a resume's preload, those after it reused)
            return self.checkpoint(background=False)

    def _train(self, iteration: int, fingerprint: str) -> dict:
        """Restore to iteration - 1 (held already, or the newest full checkpoint and a replay), update, write
        ckpt-N (lean, or in full), move trainer/LATEST."""
        cfg, store, run = self.cfg, self.store, self.cfg.run.name
        key = layout.checkpoint(run, iteration)
        t0 = time.perf_counter()
        self._restore_to(iteration - 1)
        try:
            metrics = self.update(self.engine, iteration, t0)
            if self.restored is not None:      # a new trainer: the newest full checkpoint, then the replay
                metrics["train/restore_seconds"], self.restored = self.restored, None   # (here or in preload)
        except BaseException:
            self.close()                        # a half-done update: the next request restores
            raise
        self.at, engine, meta = iteration, self.engine, {"fingerprint": fingerprint, "metrics": metrics,
                                                         "made_of": made_of(cfg, TRAIN_SECTIONS)}
        if self.resident:
            drill("lean-write", iteration)
            self.write_checkpoint(key, iteration, engine.global_step, _lean_files(engine), meta, kind="lean")
        else:                                   # the whole state: the next iteration's trainer resumes from it
            self.write_checkpoint(key, iteration, engine.global_step, lambda out: engine.save(out, iteration), meta)
            self.full_at = iteration
        if self.rank == 0:                      # one writer
            store.advance_pointer(layout.latest(run, "trainer"), key)
        if not self.resident:
            engine.barrier()                    # the others return once the checkpoint is complete
        elif iteration % cfg.train.checkpoint_every == 0:
            self.checkpoint(background=True)
        if self.resident:
            drill("answer", iteration)
        return {"key": key}

    def checkpoint(self, background: bool) -> int | None:
        """A full checkpoint of the current iteration (once): the state is copied now, written and committed on a
        thread (one at a time) or here. Returns its iteration (None: nothing trained yet)."""
        self.join()
        if self.engine is None or not self.at or self.full_at == self.at:     # (at 0: the base model)
            return self.full_at
        iteration, engine = self.at, self.engine
        files, step = engine.snapshot(iteration), engine.global_step
        key = layout.full_checkpoint(self.cfg.run.name, iteration)

        def write() -> None:
            try:
                self.write_checkpoint(key, iteration, step, files, {}, kind="full", keep_policy_here=False,
                                      before_commit=lambda: drill("full-upload", iteration))
                drill("full-done", iteration)
            except BaseException as e:          # raised by the next request (join)
                self.writer_error = e

        self.full_at = iteration
        if background and self.rank == 0:       # (the others' part, collective, was the snapshot)
            # Not a daemon: a process that ends (a caller holding the trainer) first finishes the write.
            self.writer = threading.Thread(target=write, name=f"rlflow-full-{iteration}")
            self.writer.start()
        else:
            write()
            self.join()
        return iteration

    # ------------------------------------------------------------------ one iteration's steps, on any engine

    def update(self, engine: TrainingEngine, iteration: int, t0: float | None = None) -> dict:
        """Iteration `iteration`'s update of `engine` on its stored scored rollouts, by the learner train.algorithm
        names: the rows it trains on (this iteration's, and the earlier and off-line ones it replays, loaded
        here), what it makes of their rewards over the whole batch (groups complete), this process's shard of
        micro-batches, the optimiser passes. Returns the train/* metrics (`t0`: when the stage started)."""
        cfg, store = self.cfg, self.store
        t0 = time.perf_counter() if t0 is None else t0
        tc = cfg.train
        learner = make_learner(cfg, iteration)
        records = rollout.load(store, layout.rewards(cfg.run.name, iteration))
        rewards = torch.tensor([math.nan if r.reward is None else r.reward for r in records], dtype=torch.float64)
        older = [r for k in learner.replay(iteration) for r in rollout.load(store, layout.rewards(cfg.run.name, k))]
        offline = [r for key in offline_rollouts(cfg, store) for r in rollout.load(store, key)]
        records = offline + older + records
        signal = episode_signal(learner, records)
        batches = shard_batches(records, signal, engine.tokenizer.pad_token_id, tc, engine.device, engine.rank,
                                engine.world_size)
        t1 = time.perf_counter()
        # No row scored (reward.strict off and every call failed; the reward stage said so): no step, since one on
        # no signal would still move the weights (AdamW's momentum, weight decay).
        unscored = all(r.reward is None for r in records)
        if unscored:
            stats = UpdateStats(own=learner.stats() if learner.stats is not None else None)
        else:
            stats = optimise(engine, batches, cfg, iteration, learner)
        engine.global_step += tc.num_iterations
        metrics = stats.metrics(rewards, signal, tc, time.perf_counter() - t0, learner)
        metrics["train/skipped"] = float(unscored)
        if learner.off_policy:
            metrics["train/rows"] = float(len(records))       # this iteration's, the replayed and the off-line
        metrics["train/update_seconds"] = time.perf_counter() - t1        # the optimiser passes alone
        return metrics

    def restore(self, iteration: int) -> TrainingEngine:
        """An engine holding the trainer's state after iteration `iteration` (0: the base model): the newest full
        checkpoint at or before it, then the iterations after it replayed from their stored rewards. The last
        replayed iteration must reproduce the policy that iteration published, bit for bit on a CPU (checked:
        the weights carry every earlier step, so a divergence anywhere shows there)."""
        cfg, store = self.cfg, self.store
        key, at = newest_full(store, cfg.run.name, iteration)
        engine = training_engine(cfg).open(cfg, store, key)
        try:
            for k in range(at + 1, iteration + 1):
                self.update(engine, k)
            if iteration > at:
                _check_replay(engine, store, layout.checkpoint(cfg.run.name, iteration))
        except BaseException:
            engine.close()
            raise
        return engine

    def write_checkpoint(self, key: str, iteration: int, step: int, files: Callable[[Path], dict], meta: dict,
                         kind: str = "full", keep_policy_here: bool = True,
                         before_commit: Callable[[], None] | None = None) -> dict | None:
        """A checkpoint folder: `files(folder)` writes its files (every process calls this: deepspeed saves
        collectively) and returns what state.json adds; process 0 then writes state.json and commits the folder
        (manifest last). `kind`: full (the engine's `save` or `snapshot`: a trainer can resume from it) or lean
        (`save_policy`: the policy alone). `keep_policy_here`: the policy's files stay in this machine's cache
        too (the next generate here reads them without a download). Returns the manifest on process 0."""
        with tempfile.TemporaryDirectory(prefix="rlflow-ckpt-") as tmp:
            out = Path(tmp)
            extra = files(out)
            if self.rank != 0:
                return None
            state = {"iteration": iteration, "step": step,
                     "data_cursor": data.cursor(iteration + 1, self.cfg.generate.prompts_per_iteration), **extra}
            (out / layout.CKPT_STATE).write_text(json.dumps(state))
            if before_commit is not None:
                before_commit()
            policy = (lambda rel: rel.startswith(layout.CKPT_MODEL + "/")) if keep_policy_here else None
            return self.store.put_folder(key, out, meta={**meta, "kind": kind, "iteration": iteration},
                                         keep_local=policy, give_up=True)

    def join(self) -> None:
        if self.writer is not None:
            self.writer.join()
            self.writer = None
        if self.writer_error is not None:
            error, self.writer_error, self.full_at = self.writer_error, None, None
            raise RuntimeError(f"the background full checkpoint failed: {error}") from error

    def close(self) -> None:
        self.join()
        if self.engine is not None:
            self.engine.close()
        self.engine, self.at, self.full_at, self.rng = None, None, None, None


def _lean_files(engine: TrainingEngine) -> Callable[[Path], dict]:
    """What a lean checkpoint holds: the policy (model/). Its state.json is a full checkpoint's of the same
    iteration, so the next iteration's fingerprint does not depend on the mode."""
    def files(out: Path) -> dict:
        engine.save_policy(out / layout.CKPT_MODEL)
        return {}
    return files


def _check_replay(engine: TrainingEngine, store: Store, key: str) -> None:
    manifest = store.manifest(key)
    if manifest is None:
        raise RuntimeError(f"replay: {store.uri(key)} is missing; the stored iterations are incomplete")
    with tempfile.TemporaryDirectory(prefix="rlflow-replay-") as tmp:
        engine.save_policy(Path(tmp))
        if engine.rank != 0:
            return
        mine = {p.relative_to(tmp).as_posix(): sha256_file(p) for p in sorted(Path(tmp).rglob("*.safetensors"))}
    theirs = {rel[len(layout.CKPT_MODEL) + 1:]: f["sha256"] for rel, f in manifest["files"].items()
              if rel.startswith(layout.CKPT_MODEL + "/") and rel.endswith(".safetensors")}
    if mine != theirs:
        message = (f"replay: iteration {manifest['meta'].get('iteration')} reproduced other weights than "
                   f"{store.uri(key)} holds")
        if engine.device.type == "cpu":
            raise RuntimeError(message + " (on a CPU replay is exact: this is a bug, or the run began under an "
                               "rlflow whose update rounded otherwise: from 2026-12-03 rows of advantage 0 skip "
                               "their backward; resume it from a full checkpoint)")
        warnings.warn(message + " (GPU kernels are not bit-reproducible; training goes on from the replay)",
                      stacklevel=2)


def unfinished(store: Store, run: str) -> int | None:
    """The newest committed iteration (trainer/LATEST) when it is lean and has no full checkpoint, else None."""
    latest = store.get_pointer(layout.latest(run, "trainer"))
    if latest is None or (manifest := store.manifest(latest)) is None or manifest["meta"].get("kind") != "lean":
        return None
    iteration = manifest["meta"]["iteration"]
    return None if store.manifest(layout.full_checkpoint(run, iteration)) is not None else iteration


def drill(point: str, iteration: int) -> None:
    """Fault drills (tests/test_resident.py, tests/test_sft.py): RLFLOW_DRILL=<point>:<iteration> kills this
    process there, once (RLFLOW_DRILL_ONCE names a file that marks it done). Points: lean-write (trained, nothing
    written), full-upload (a full checkpoint written locally, not yet in the store), full-done (committed), answer
    (everything committed, the stage not yet told); sft-step (the warm start's step N done, not checkpointed).
    RLFLOW_DRILL_SIGNAL=STOP stops it there instead (SIGSTOP: a hung trainer, which its callers must stop)."""
    once = os.environ.get("RLFLOW_DRILL_ONCE")
    if os.environ.get("RLFLOW_DRILL") != f"{point}:{iteration}" or not once or os.path.exists(once):
        return
    if int(os.environ.get("RANK") or 0) != 0:   # a group: its process 0 is killed (torchrun stops the others)
        return
    import signal

    Path(once).write_text(point)
    how = os.environ.get("RLFLOW_DRILL_SIGNAL", "KILL")
    print(f"drill: {'stopping' if how == 'STOP' else 'killing'} the trainer at {point} of iteration {iteration}",
          flush=True)
    os.kill(os.getpid(), signal.SIGSTOP if how == "STOP" else signal.SIGKILL)


# ------------------------------------------------------------------------------------------- in this process

_HELD: dict[str, tuple[str, Trainer]] = {}   # run name -> (trainer key, trainer): the trainers this process holds
_HELD_LOCK = threading.Lock()                # one request at a time, as a detached trainer answers them


class InProcessTrainer:
    """The trainer in this process, called directly: nothing to start, no socket.

    held (train.mode resident, train.host caller): the run's trainer, kept in this process across handles (the
    flow's own with the inline launcher), the same Trainer a detached one runs. It ends with the process; the next
    one resumes by replay, as after a lost detached trainer.
    not held (train.mode process): a trainer of this handle's own, for one iteration: open, train once (ckpt-N in
    full), close. (With deepspeed that is each process of a group: the stage's handle is then a GroupTrainer,
    tasks/engines/detached.py, unless this process is a member of a torchrun group started by hand.)"""

    def __init__(self, cfg: Config, held: bool = True):
        # (the key tells a held trainer made for another config; a trainer of the handle's own needs none)
        self.cfg, self.held, self.key = cfg, held, trainer_key(cfg) if held else None
        self.own: Trainer | None = None

    def train(self, iteration: int, fingerprint: str) -> dict:
        if not self.held:
            return self._own().train(iteration, fingerprint)
        with _HELD_LOCK:
            return self._held().train(iteration, fingerprint)

    def preload(self, iteration: int) -> int:
        if not self.held:
            return self._own().preload(iteration)
        with _HELD_LOCK:
            return self._held().preload(iteration)

    def finish(self, catch_up: bool = False) -> int | None:
        """A full checkpoint of the held trainer's last iteration, then it is let go; None: none held. With
        `catch_up`, when none is held: a full checkpoint of the run's newest iteration if it lacks one (restored
        here by replay: the process that trained it died after committing it)."""
        if not self.held:                       # (its ckpt-N is full already)
            full = self.own.full_at if self.own is not None else None
            self.close()
            return full
        with _HELD_LOCK:
            held = _HELD.pop(self.cfg.run.name, None)
            if held is None or held[0] != self.key:
                if held is not None:
                    held[1].close()
                if not catch_up:
                    return None
                held = (self.key, self._new(resident=True))
            trainer = held[1]
            try:
                return trainer.final_checkpoint()
            finally:
                trainer.close()

    def close(self) -> None:
        if self.own is not None:
            own, self.own = self.own, None
            own.close()

    def _held(self) -> Trainer:
        """The run's trainer this process holds (made now if none is, or the one held was made for another
        config: its state cannot serve ours). Called under _HELD_LOCK."""
        run = self.cfg.run.name
        held = _HELD.get(run)
        if held is None or held[0] != self.key:
            if held is not None:
                _HELD.pop(run)[1].close()
            held = _HELD[run] = (self.key, self._new(resident=True))
        return held[1]

    def _own(self) -> Trainer:
        if self.own is None:
            self.own = self._new(resident=False)
        return self.own

    def _new(self, resident: bool) -> Trainer:
        return Trainer(self.cfg, open_store(self.cfg), int(os.environ.get("RANK") or 0), resident=resident)

"""Recovering a stage run: which failures Prefect retries (`retryable`), the repair of a committed artifact
found corrupt (`Repair`), made again by the stage that produced it (`producer_of`), and the one line `rlflow`
ends with when a failure stays (`final_line`).

    stage = Repair(run_stage.with_options(retries=..., retry_condition_fn=retryable), ctx, log)
    g = stage("generate", 3, ctx, policy)       # a corrupt rewards/ or checkpoint it reads is made again first

Why here and not in the loop: both answer "this stage failed: what now?", which the loop (flows/training.py)
never needs to read to follow an iteration. Retries are for the infrastructure (a killed process, a preempted
cluster); a user's mistake fails the run at once; a corrupt artifact is neither (retrying would read the same
bad bytes) and every stage is deterministic, so its producer makes the same artifact again.
"""

from __future__ import annotations

import re

from tasks.core import layout
from tasks.core.errors import UserError, cause_of, disk_full
from tasks.core.lease import LeaseLost
from tasks.core.s3_calls import store_gone
from tasks.core.stage import STOP
from tasks.core.store import CorruptArtifact

# Where each stage's output of an iteration lives: the loop checks a launched stage left it, Repair reads it
# backwards (which stage of which iteration made this key).
OUTPUT_KEY = {"generate": layout.rollouts, "reward": layout.rewards, "train": layout.checkpoint,
              "publish": layout.policy, "evaluate": layout.evaluation}


def retryable(task, task_run, state) -> bool:
    """Prefect retry condition: retry infrastructure failures, never a user's mistake or a lost lease, nor
    anything once the run was told to stop. A corrupt artifact is not retried either: Repair recomputes it; nor
    a full disk (the same disk is as full at the retry: the run stops with one line, resumable)."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return (cause_of(exc, (UserError, LeaseLost, CorruptArtifact)) is None and disk_full(exc) is None
            and store_gone(exc) is None and not STOP.is_set())


def final_line(exc: BaseException, retries: int | None = None) -> tuple[str, int] | None:
    """What `rlflow` says of a run that ended with `exc`, and its exit code, where one line says it all: a user's
    mistake (2); a full disk, or a fault of the machinery retried already and failing every time (1: what is
    committed stays, the same command resumes; `retries`: the run's launcher.retries, where known); a damaged file
    of the store no stage makes again (1: a policy to export, or to resume from). None: an error nobody foresaw (a
    traceback serves it better)."""
    if (user := cause_of(exc, UserError)) is not None:
        return f"error: {user}", 2
    if (full := disk_full(exc)) is not None:
        return f"error: {full}", 1
    if (gone := store_gone(exc)) is not None:
        return f"error: {gone}", 1
    if (corrupt := cause_of(exc, CorruptArtifact)) is not None:    # (what reaches here no stage can make again)
        return f"error: {corrupt}: a file of the store is damaged, and no stage of rlflow makes it again", 1
    from flows.launch import InfraError  # (after the user's mistake: said whatever these import)
    from tasks.core.tracking import TrackingUnanswered
    from tasks.envs.runtime.episodes import EnvironmentsStalled
    from tasks.envs.runtime.server import ServerGone
    from tasks.scoring.judges import JudgeUnavailable

    if (gone := cause_of(exc, TrackingUnanswered)) is not None:    # (it says what MLflow lacks, and the way on)
        return f"error: {gone}", 1
    if (infra := cause_of(exc, (InfraError, EnvironmentsStalled, ServerGone, JudgeUnavailable))) is not None:
        said = " ".join(str(infra).split())[:600]
        tried = ("not retried (launcher.retries: 0)" if retries == 0 else
                 f"retried as launcher.retries{f' ({retries})' if retries else ''} says and failed each time")
        return f"error: {said}; {tried} (the flow's log holds the details): run the same command to resume", 1
    return None


def output_key(cfg, stage: str, iteration: int, round: int = 0) -> str:
    """Where a stage run leaves its output: dynamic sampling's rounds have keys of their own (tasks/core/layout.py)."""
    if stage == "generate":
        return layout.rollouts(cfg.run.name, iteration, round)
    if stage == "reward" and cfg.generate.dynamic_sampling is not None:
        return layout.scored(cfg.run.name, iteration, round)
    return OUTPUT_KEY[stage](cfg.run.name, iteration)


def producer_of(run: str, key: str) -> tuple[str, int, int] | None:
    """(stage, iteration, round) whose output `key` is, or None (not a stage's output: nothing can make it
    again)."""
    rounds = re.fullmatch(r".*/(rollouts|scored)-r(\d+)", key)
    for it in _numbers_in(run, key):
        for stage, out in OUTPUT_KEY.items():
            if it >= 1 and out(run, it) == key:
                return stage, it, 0
        if rounds and it >= 1:
            stage, r = ("generate" if rounds[1] == "rollouts" else "reward"), int(rounds[2])
            if key in (layout.rollouts(run, it, r), layout.scored(run, it, r)):
                return stage, it, r
    return None


def _numbers_in(run: str, key: str) -> set[int]:
    """The numbers in `key` after the run's name: the iterations it may be an output of."""
    return {int(d) for d in re.findall(r"\d+", key[len(run):])}


class Repair:
    """The stage task, with one more way to recover: a stage that finds a committed artifact corrupt (its bytes
    changed after its manifest was written: bit rot, a bad copy, a hand edit) has that artifact quarantined
    (store.quarantine) and made again by the stage that produced it (every stage is deterministic, so it is
    the same artifact), then runs again. Said once, in one line; an artifact that cannot be made again (its
    inputs are gone, or it is corrupt again) ends the run with one line naming the file. `ctx` is the flow's Run
    (flows/training.py): its config and store."""

    def __init__(self, stage, ctx, log):
        self.stage, self.ctx, self.log = stage, ctx, log
        self.note = print            # the console line (the flow sets its progress display's)

    def __call__(self, name: str, it: int, ctx, *args, **kwargs):
        return self._repairing(lambda: self.stage(name, it, ctx, *args, **kwargs), set())

    def submit(self, *args, **kwargs):
        return self.stage.submit(*args, **kwargs)

    def result(self, future, name: str, it: int, ctx, *args, **kwargs):
        """A submitted stage's result; if it found a corrupt artifact, repaired and run again here."""
        return self._repairing(future.result, set(), again=lambda: self.stage(name, it, ctx, *args, **kwargs))

    def _repairing(self, call, seen: set, again=None):
        while True:
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - only a corrupt artifact is handled here
                bad = cause_of(e, CorruptArtifact)
                if bad is None:
                    raise
                self._remake(bad, seen)
                call = again or call

    def _remake(self, bad: CorruptArtifact, seen: set) -> None:
        run, store = self.ctx.cfg.run.name, self.ctx.store
        if bad.key in seen:
            raise UserError(f"{bad}: still corrupt after it was made again; the store is damaged") from None
        seen.add(bad.key)
        producer = producer_of(run, bad.key)
        moved = store.quarantine(bad.key)
        if producer is None:
            if not any(bad.key in (layout.full_checkpoint(run, it), layout.curriculum(run, it))
                       for it in _numbers_in(run, bad.key)):
                raise UserError(f"{bad}: corrupt, and no stage makes it (moved to {store.uri(moved)}); restore it "
                                f"or start a new run.name") from None
            # a resident trainer's full checkpoint, the curriculum's state: the stage that read it runs again and
            # rebuilds that state from the one before it (an older full checkpoint and the stored rewards since)
            said = f"corrupt artifact: {bad}; moved to {store.uri(moved)}, rebuilding it from the state before it"
            self.log.warning(said)
            self.note(said)
            return
        stage, it, round = producer
        if stage == "reward" and self.ctx.cfg.generate.dynamic_sampling is not None:
            # (the iteration's rewards are made by its last round's reward stage, which reads every round)
            round = max((r for r in range(self.ctx.cfg.generate.dynamic_sampling.max_rounds)
                         if store.manifest(layout.scored(run, it, r)) is not None), default=0)
        which = f"{stage} of iteration {it}" + (f" round {round}" if round else "")
        said = f"corrupt artifact: {bad}; moved to {store.uri(moved)}, making it again ({which})"
        self.log.warning(said)
        self.note(said)
        args = (layout.behaviour_policy(run, it, self.ctx.cfg.run.max_staleness),) if stage == "generate" else ()
        extra = {"round": round} if round else {}
        try:
            self._repairing(lambda: self.stage(stage, it, self.ctx, *args, **extra), seen)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{bad}: corrupt, and making it again failed ({str(e).splitlines()[0][:200]}); "
                            f"restore it or start a new run.name") from None

"""Groups scored as they complete (generate.streaming, issue 42): the reward functions score each group the
streaming sampler commits, on a thread of the flow's process, while later groups decode; the reward stage then
takes an iteration's scored groups instead of scoring it at once (tasks/reward.py).

    scorer = GroupScorer.start(cfg)                    # the streaming sampler's listener (tasks/generate.py)
    scorer.submit(iteration, group, records)           # a committed group: scored and stored in turn
    records, scored, seconds = assembled(cfg, store, iteration, rollouts)    # or None: score it at once

Only reward functions score here (reward.models' judges are the reward stage's services) and only with the reward
stage inline (in the flow's process, as the sampler is). A function is called on one group at a time (TRL's
calling convention holds for any batch), its log_metric values averaged over the groups. A scoring that fails
(reward.strict's error, a worker that cannot start) stops the scorer; a call that fails leaves its group and the
rest of its iteration unscored here (nothing stored: a resume scores them again). The reward stage then scores
the iteration itself, once, and says that error there. More: docs/design-notes.md (Generation that never waits).
"""

from __future__ import annotations

import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import layout, rollout
from tasks.core.contracts import Rollout, Scored
from tasks.core.placement import placement_of
from tasks.core.stage import fingerprinted_as, scored_fingerprint
from tasks.core.store import Store, open_store
from tasks.scoring.functions import load_functions, score_records
from tasks.scoring.shaping import add_overlong
from tasks.scoring.worker import RewardState

if TYPE_CHECKING:
    from tasks.core.config import Config


class GroupScorer:
    """One run's scorer: a thread that scores the groups submitted to it, in order, each into
    `<run>/iter-N/stream/scored-J` (manifest last), then tells `on_scored(iteration, group, records)` if set (the
    sampler: generate.dynamic_sampling's verdicts). `wait(N)` returns once iteration N's groups submitted here are
    scored, or the scorer has stopped."""

    RUNNING: dict[str, GroupScorer] = {}
    LOCK = threading.Lock()

    @classmethod
    def start(cls, cfg: Config) -> GroupScorer:
        """A scorer for a new sampler (each its own: one being stopped with a failed sampler is never reused);
        the run's reward stage waits on the newest."""
        with cls.LOCK:
            s = cls.RUNNING[cfg.run.name] = GroupScorer(cfg)
            return s

    def __init__(self, cfg: Config):
        self.cfg, self.store = cfg, open_store(cfg)
        self.fp = scored_fingerprint(cfg)
        self.todo: queue.Queue = queue.Queue()
        self.submitted: set[tuple[int, int]] = set()
        self.done: set[tuple[int, int]] = set()
        self.failed: set[int] = set()          # iterations a group's call failed in: the reward stage scores them
        self.budgeted: int | None = None       # the iteration whose groups' output shares one budget now
        self.error: BaseException | None = None
        self.on_scored = None
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"rlflow-score-{cfg.run.name}", daemon=True)
        self.thread.start()

    def submit(self, iteration: int, group: int, records: list[Rollout]) -> None:
        with self.changed:
            self.submitted.add((iteration, group))
        self.todo.put((iteration, group, records))

    def stop(self) -> None:
        """Score what was submitted, then end (the sampler's end)."""
        self.todo.put(None)
        self.thread.join()
        with GroupScorer.LOCK:
            if GroupScorer.RUNNING.get(self.cfg.run.name) is self:
                del GroupScorer.RUNNING[self.cfg.run.name]

    def wait(self, iteration: int) -> None:
        """Until the groups of iteration `iteration` submitted here are scored (or the scorer stopped)."""
        with self.changed:
            while {g for g in self.submitted if g[0] == iteration} - self.done and self.error is None \
                    and self.thread.is_alive():
                self.changed.wait(0.2)

    def _run(self) -> None:
        functions = None
        try:
            while (item := self.todo.get()) is not None:
                if item[0] not in self.failed:
                    functions = functions or load_functions(self.cfg)
                    if not self._score(functions, *item):
                        self.failed.add(item[0])
                with self.changed:
                    self.done.add(item[:2])
                    self.changed.notify_all()
                if self.on_scored is not None:                   # (no verdict from a group left unscored)
                    self.on_scored(*item[:2], None if item[0] in self.failed else item[2])
        except BaseException as e:  # noqa: BLE001 - the reward stage scores the iteration itself and says it
            self.error = e
        finally:
            with self.changed:
                self.changed.notify_all()

    def _score(self, functions, iteration: int, group: int, records: list[Rollout]) -> bool:
        """Group `group` scored and stored; False (nothing stored) where a function's call failed."""
        cfg, t0 = self.cfg, time.perf_counter()
        renew, self.budgeted = self.budgeted != iteration, iteration
        scored = score_records(functions, records, cfg.reward.aggregate,
                               RewardState(global_step=iteration - 1, max_steps=cfg.run.iterations),
                               renew_output=renew)
        if scored.errors:
            return False
        add_overlong(cfg, records)
        with tempfile.TemporaryDirectory(prefix="rlflow-scored-") as tmp:
            rollout.write(records, Path(tmp))
            self.store.put_folder(layout.stream_scored(cfg.run.name, iteration, group), Path(tmp), meta={
                "names": list(scored.scores), "errors": scored.errors, "nan": scored.nan,
                "metrics": scored.metrics, "seconds": time.perf_counter() - t0, "fingerprint": self.fp})
        return True


def assembled(cfg: Config, store: Store, iteration: int,
              rollouts: list[Rollout]) -> tuple[list[Rollout], Scored, float] | None:
    """Iteration `iteration`'s records as its groups were scored (in the rollouts' order), what the scoring
    said (Scored: scores, errors, NaN counts, metrics) and its seconds; None unless every group of it (its
    prompts', and generate.dynamic_sampling's extra ones) was scored as it completed, from these very rollouts."""
    if not placement_of(cfg).scores_as_groups_complete():
        return None
    if (scorer := GroupScorer.RUNNING.get(cfg.run.name)) is not None:
        scorer.wait(iteration)
    keys = [layout.stream_scored(cfg.run.name, iteration, j) for j in sorted({r.group for r in rollouts})]
    manifests = [store.manifest(k) for k in keys]
    fp = scored_fingerprint(cfg)
    if not all(fingerprinted_as(m, fp) for m in manifests):
        return None
    records = [r for k in keys for r in rollout.load(store, k)]
    if [(r.row, r.completion_ids) for r in records] != [(r.row, r.completion_ids) for r in rollouts]:
        return None
    metas = [m["meta"] for m in manifests]
    out = Scored(scores={name: [r.rewards.get(name) for r in records] for name in metas[0]["names"]})
    for meta in metas:
        for name, message in meta["errors"].items():
            out.errors.setdefault(name, message)
        for name, count in meta["nan"].items():
            out.nan[name] = out.nan.get(name, 0) + count
    for name in {name for meta in metas for name in meta["metrics"]}:
        values = [meta["metrics"][name] for meta in metas if name in meta["metrics"]]
        out.metrics[name] = sum(values) / len(values)
    return records, out, sum(meta["seconds"] for meta in metas)

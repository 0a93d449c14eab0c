"""tasks/core/tracking.py's Tracker on a real MLflow sqlite database: what it logs through its flushing thread, and
that the thread ends with the run (a process that runs many flows, a tuning study's or a Prefect worker's, kept
one idle thread per run before)."""

from __future__ import annotations

import threading

from tasks.core.config import load_config
from tasks.core.tracking import Tracker
from tests.conftest import TINY


def _trackers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "rlflow-tracking" and t.is_alive()]


def test_the_flushing_thread_ends_with_the_run_and_what_it_logged_is_there(tmp_path):
    from mlflow.tracking import MlflowClient

    before = set(_trackers())
    for n in range(3):           # three runs in one process, as a study's trials
        cfg = load_config(TINY, [f"run.name=threads-{n}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                 "tracking.flush_seconds=0", "publish.register_model=false"])
        tracker = Tracker(cfg, f"file://{tmp_path}/store")
        run_id = tracker.start()
        tracker.log_iteration(1, {"reward/mean": 0.25})
        tracker.log_iteration(2, {"reward/mean": 0.5})
        assert set(_trackers()) - before, "the metrics go through the flushing thread"
        tracker.end()
        assert not set(_trackers()) - before, f"run {n}'s flushing thread is still alive after end()"
        history = MlflowClient(cfg.tracking.uri).get_metric_history(run_id, "reward/mean")
        assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
        assert MlflowClient(cfg.tracking.uri).get_run(run_id).info.status == "FINISHED"
    tracker.log_iteration(3, {"reward/mean": 0.75})      # (after end: flushed in this thread, none started)
    tracker.drain()
    assert not set(_trackers()) - before
    assert [m.step for m in MlflowClient(cfg.tracking.uri).get_metric_history(run_id, "reward/mean")] == [1, 2, 3]

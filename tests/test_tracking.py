"""tasks/core/tracking.py's Tracker on a real MLflow sqlite database: what it logs through its flushing thread, and
that the thread ends with the run (a process that runs many flows, a tuning study's or a Prefect worker's, kept
one idle thread per run before)."""

from __future__ import annotations

import threading

import pytest

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


def test_an_mlflow_run_whose_iterations_the_store_lost_is_left_to_them_and_a_new_one_made(tmp_path):
    """The store's run folder deleted (to start the run over), MLflow's run kept: the run trains from iteration 1
    again, and its MLflow run was the earlier one, whose logged iterations made the flow log none of the new
    ones (the dashboard showed the earlier run's curve). Now that MLflow run is left as it was, said on the
    console, and a new one takes the run; a store that holds the first iteration, or a policy past v0, keeps its
    MLflow run."""
    import tempfile
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from tasks.core import layout
    from tasks.core.store import Store

    cfg = load_config(TINY, ["run.name=again", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                             "tracking.flush_seconds=0", "publish.register_model=false"])
    store = Store.open(str(tmp_path / "store"))
    earlier = Tracker(cfg, store.root)
    first = earlier.start(store)
    earlier.log_iteration(1, {"reward/mean": 0.25})
    earlier.log_iteration(2, {"reward/mean": 0.5})
    earlier.end()
    again = Tracker(cfg, store.root)
    second = again.start(store)                               # (the store holds no iteration of the run)
    assert second != first and again.last_logged_iteration() == 0
    assert again.superseded == (f"MLflow run {first} logged iterations of an earlier run again whose outputs are "
                                f"gone from {store.uri('again')}: this run logs to a new one")
    client = MlflowClient(cfg.tracking.uri)
    assert client.get_run(first).info.status == "FINISHED"                      # left as it was
    again.log_iteration(1, {"reward/mean": 0.75})
    again.end()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "rollouts.jsonl").write_text("{}\n")
        store.put_folder(layout.rewards("again", 1), Path(tmp), meta={})
    resumed = Tracker(cfg, store.root)
    assert resumed.start(store) == second and resumed.superseded is None          # the newest, and its store's
    resumed.end()
    store.delete_folder(layout.rewards("again", 1))          # (iteration 1's folder deleted by hand to save space:
    with tempfile.TemporaryDirectory() as tmp:                                          # the run's, all the same)
        (Path(tmp) / "model.safetensors").write_bytes(b"x")
        store.put_folder(layout.policy("again", 2), Path(tmp), meta={})
    store.set_pointer(layout.latest("again", "policy"), layout.policy("again", 2))
    kept = Tracker(cfg, store.root)
    assert kept.start(store) == second and kept.superseded is None
    kept.end()


def test_a_policy_uri_registered_by_an_earlier_run_is_a_new_version_for_this_one(tmp_path):
    """A run started over (its store's folder deleted) publishes the same policy URIs with other weights: the
    publish stage's registration found the earlier run's version by URI and returned it (the registry's version
    named the earlier run and its evaluation). Now a version is this MLflow run's; `export --register` takes the
    newest."""
    from mlflow.tracking import MlflowClient

    from tasks.core.registry import _find_version, ensure_registered_model, register_policy

    cfg = load_config(TINY, ["run.name=over", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"])
    client = MlflowClient(cfg.tracking.uri)
    ensure_registered_model(client, "over")
    exp = client.create_experiment("over")
    earlier, later = (client.create_run(exp).info.run_id for _ in range(2))
    uri = f"file://{tmp_path}/store/over/policy/v000001"
    assert register_policy(cfg, earlier, uri, 1) == "1"
    assert register_policy(cfg, later, uri, 1) == "2"
    assert register_policy(cfg, later, uri, 1) == "2"                      # (again: the same version)
    assert client.get_model_version("over", "2").run_id == later
    assert _find_version(client, "over", uri) == "2"
    from flows.export import _mlflow_policy
    from tasks.core.store import Store

    store = Store.open(str(tmp_path / "store"))                  # (models:/NAME/latest: MLflow's newest version)
    assert _mlflow_policy(cfg, store, "models:/over/latest") == "over/policy/v000001"
    import pytest

    from tasks.core.errors import UserError

    for bad in ("models:/over/1@x", "models:/over@champion/1", "models:/over"):
        with pytest.raises(UserError, match="expected models:/NAME/VERSION or models:/NAME@ALIAS"):
            _mlflow_policy(cfg, store, bad)


def test_a_champion_of_an_earlier_run_whose_store_is_gone_is_no_champion(tmp_path):
    """The store's run folder deleted and the run started over: the earlier run's champion named weights that are
    gone, and the new run's evaluations had to beat its score to move the alias (`start_from: champion` fetched
    nothing). The alias is removed as the new MLflow run takes the run, and said; a champion of another run stays."""
    from mlflow.tracking import MlflowClient

    from tasks.core.registry import champion, promote_if_better, register_policy
    from tasks.core.store import Store

    store = Store.open(str(tmp_path / "store"))
    for name, theirs in (("gone", True), ("other", False)):
        cfg = load_config(TINY, [f"run.name={name}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                 "tracking.flush_seconds=0", "publish.registered_model_name=shared"])
        client = MlflowClient(cfg.tracking.uri)
        earlier = Tracker(cfg, store.root)
        first = earlier.start(store)
        earlier.log_iteration(1, {"reward/mean": 0.25})
        earlier.end()
        owner = first if theirs else client.create_run(earlier.experiment_id).info.run_id
        version = register_policy(cfg, owner, f"{store.uri(name)}/policy/v000001", 1, client)
        assert promote_if_better(client, "shared", version, "eval/reward_mean", 0.9)
        again = Tracker(cfg, store.root)
        again.start(store)
        again.end()
        if theirs:
            assert champion(client, "shared") is None
            assert again.superseded.endswith(f"; its champion (version {version}) is no champion now")
        else:
            assert str(champion(client, "shared").version) == version and "no champion" not in again.superseded


def test_a_prefect_api_that_stops_answering_holds_the_report_not_the_run(tmp_path, prefect_api, monkeypatch, capsys):
    """The run's report card is posted to the Prefect API every tracking.dashboard_every iterations; an API that
    stopped answering (SIGSTOPped: its socket takes the connection, nothing comes back) held the run in that post
    for good. Now a post waits POST_SECONDS, says so once, and the run goes on; while one is still on its way the
    next is skipped, and a later one goes out once the API answers again."""
    import socket

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import dashboard
    from tasks.core.config import load_config
    from tests.conftest import TINY

    monkeypatch.setattr(dashboard, "POST_SECONDS", 1.0)
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=card"])
    report = dashboard.Report(cfg, {"run": "r", "view": "v"}, "file://store")
    metrics = {"reward/mean": 0.5, "train/loss": 0.1}
    hung = socket.socket()                      # accepts (the kernel's backlog), never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    try:
        with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{hung.getsockname()[1]}/api"}):
            report.post(1, metrics, [], "p1")
            first = report.sending
            report.post(2, metrics, [], "p2")                       # the first still waits: skipped
            assert report.sending is first and first.is_alive() and report.posted == 1     # (2: not posted)
        assert capsys.readouterr().err.count("warning: the Prefect API did not take the run's report in 1 s") == 1
    finally:
        hung.close()                                                # (the waiting post ends: refused)
    first.join(120)
    report.post(3, metrics, [], "p3")                               # the API answers: this one goes out
    report.sending.join(120)
    with get_client(sync_client=True) as client:
        assert any((a.description or "").startswith("iteration 3/") for a in client.read_artifacts())


@pytest.mark.server
def test_a_tracking_server_that_stops_answering_holds_the_run_end_for_a_bounded_time(tmp_path, monkeypatch):
    """A tracking server stopped mid-run (SIGSTOP: it accepts, never answers): the loop went on (log_iteration
    returns at once), but the run's end waited on it for good (each MLflow request waits 120 s and retries, and
    end() drained and closed the run again after a failed drain). Now drain gives up after ANSWER_SECONDS without
    an answer, saying which iterations MLflow lacks and the way on (the same command logs them from the store),
    end() sends nothing more, and `rlflow` says it in one line."""
    import os
    import signal
    import sys

    from flows.repair import final_line
    from tasks.core import tracking
    from tests.conftest import _free_port, _serve, _stop

    home, port = tmp_path / "server", _free_port()
    home.mkdir()
    proc = _serve([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers",
                   "1", "--backend-store-uri", f"sqlite:///{home}/mlflow.db", "--artifacts-destination",
                   str(home / "artifacts")], {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
                  f"http://127.0.0.1:{port}/health", home / "server.log")
    uri, outcome = f"http://127.0.0.1:{port}", {}
    try:
        cfg = load_config(TINY, ["run.name=unanswered", f"tracking.uri={uri}", "tracking.flush_seconds=0",
                                 "publish.register_model=false"])
        tracker = Tracker(cfg, f"file://{tmp_path}/store")
        tracker.start()
        tracker.log_iteration(1, {"reward/mean": 0.25})
        tracker.drain()                            # (answered: logged)
        monkeypatch.setattr(tracking, "ANSWER_SECONDS", 2.0, raising=False)   # (only a stopped server sees it)
        os.killpg(proc.pid, signal.SIGSTOP)
        tracker.log_iteration(2, {"reward/mean": 0.5})
        tracker.log_iteration(3, {"reward/mean": 0.75})

        def ending():
            try:
                tracker.drain()
            except Exception as e:  # noqa: BLE001 - what drain raised is the test's subject
                outcome["drain"] = e
            tracker.end("FAILED")
            outcome["ended"] = True

        waiter = threading.Thread(target=ending, daemon=True)
        waiter.start()
        waiter.join(180)
        assert outcome.get("ended"), "drain/end still waiting on a tracking server that answers nothing"
        said = final_line(outcome["drain"])
        assert said == (f"error: MLflow at {uri} has not answered for 2 s: iterations 2-3 are stored but not logged "
                        "there; the same command run again when it answers logs them (nothing is lost: the store "
                        "has the run)", 1), said
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        _stop(proc)


def test_an_iterations_pictures_reach_mlflow_before_its_metrics(tmp_path, monkeypatch):
    """An evaluation's pictures were uploaded after the iteration's metrics, whose reward/mean marks it logged: a
    run killed (or a server given up on) between the two resumed past them, and they were never uploaded. They go
    with the iteration now, file by file (each an answer of the server's), before its metrics."""
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(tmp_path)                 # (a sqlite database's artifacts go to ./mlruns)
    cfg = load_config(TINY, ["run.name=pictures", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                             "tracking.flush_seconds=0", "publish.register_model=false"])
    tracker = Tracker(cfg, f"file://{tmp_path}/store")
    run_id = tracker.start()
    folder = tmp_path / "screens"
    (folder / "e00").mkdir(parents=True)
    (folder / "index.json").write_text("{}")
    (folder / "e00" / "00.jpg").write_bytes(b"\xff\xd8")
    calls = []
    for name in ("log_artifact", "log_artifacts", "log_batch"):
        real = getattr(tracker.client, name)
        monkeypatch.setattr(tracker.client, name, lambda *a, _real=real, _name=name, **k: (calls.append(_name),
                                                                                          _real(*a, **k))[1])
    tracker.log_iteration(1, {"reward/mean": 0.5}, folders=[(folder, "screens/v000001")])
    tracker.end()
    assert calls == ["log_artifact", "log_artifact", "log_batch"]
    client = MlflowClient(cfg.tracking.uri)
    assert {a.path for a in client.list_artifacts(run_id, "screens/v000001")} == {"screens/v000001/index.json",
                                                                                 "screens/v000001/e00"}
    assert [a.path for a in client.list_artifacts(run_id, "screens/v000001/e00")] == ["screens/v000001/e00/00.jpg"]

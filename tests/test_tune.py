"""`rlflow tune` (flows/tune.py): a small study over the tiny demo's learning rate, two trials at a time, killed
(its whole process group, as a preemption would) after its first trial and run again: finished trials are not
repeated, the one that was running resumes its run, the best config loads and is the best trial's; MLflow has
one parent run and, nested under it, one run per trial (the trial's own rlflow run, a resumed one continued),
Prefect a table artifact of the trials. Bad spaces: test_bad_input."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core.config import load_config
from tests.conftest import AT_LENGTH, TINY

pytestmark = pytest.mark.slow
TRIALS = 3


def _tune(tmp_path: Path, prefect_api: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "flows.cli", "tune", str(TINY), "--space", str(tmp_path / "space.yaml"),
            "--trials", str(TRIALS), "--parallel", "2", "--window", "3", "--pruner", "none",
            "--out", str(tmp_path / "tune"), "-o", "run.iterations=8",
            "-o", f"store.uri=file://{tmp_path}/store", "-o", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    return subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, "PREFECT_API_URL": prefect_api},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _trials(tmp_path: Path):
    import optuna
    from sqlalchemy.exc import SQLAlchemyError

    db = tmp_path / "tune" / "study.db"
    if not db.exists():
        return []
    storage = f"sqlite:///{db}"
    try:
        return optuna.load_study(study_name="tiny-demo-tune", storage=storage).get_trials(deepcopy=False)
    except KeyError:                  # (not created yet)
        return []
    except SQLAlchemyError:           # (its schema being created by the tune at this moment: ask again later)
        return []


def _children(client, experiment: str):
    exp = client.get_experiment_by_name(experiment)
    [parent] = client.search_runs([exp.experiment_id], "tags.`rlflow.tune.study` = 'tiny-demo-tune'")
    return parent, client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")


def test_a_metric_the_runs_do_not_log_ends_the_tune_in_one_line(tmp_path, prefect_api):
    """--metric of a name no manifest has (reward/..., but not a metric rlflow logs): the first trial's run
    completes, and the tune ends there with one line naming --metric and what the run did log, exit 2 (not
    "no trial completed" after every trial has run). Run from a folder with a `tasks` and a `flows` package of
    the user's: the trial's run (a child Python) imports rlflow's (tests/test_shadowing.py)."""
    from tests.test_shadowing import _shadowing

    mark = _shadowing(tmp_path / "project")
    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-4, high: 1.0e-2}\n")
    rlflow = Path(sys.executable).with_name("rlflow")
    cli = [str(rlflow)] if rlflow.exists() else [sys.executable, "-P", "-m", "flows.cli"]
    argv = [*cli, "tune", str(TINY), "--space", str(tmp_path / "space.yaml"),
            "--trials", "3", "--metric", "reward/nonexistent", "--out", str(tmp_path / "tune"),
            "-o", "run.iterations=1", "-o", f"store.uri=file://{tmp_path}/store",
            "-o", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    out = subprocess.run(argv, cwd=tmp_path / "project", env={**os.environ, "PREFECT_API_URL": prefect_api},
                         capture_output=True, text=True, timeout=600)
    assert not mark.exists(), out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("error: --metric: reward/nonexistent: the trial's run completed "
                                                   "without logging it; its iteration 1 logged "), out.stderr[-2000:]
    assert "reward/mean" in last and "expected one of those" in last
    assert len(_trials(tmp_path)) == 1                  # the tune stopped at the first trial


@AT_LENGTH               # (~60 s; the trial bookkeeping test below is CI's smoke of rlflow tune)
@pytest.mark.slow
@pytest.mark.drill
def test_a_tune_finds_a_better_learning_rate_and_resumes_after_a_kill(tmp_path, prefect_api):
    from mlflow import MlflowClient
    from optuna.trial import TrialState

    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-5, high: 3.0e-2}\n")
    first = _tune(tmp_path, prefect_api)
    deadline = time.monotonic() + 300
    while not any(t.state == TrialState.COMPLETE for t in _trials(tmp_path)):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read()[-3000:]
        time.sleep(0.5)
    os.killpg(first.pid, signal.SIGKILL)                       # the tune and its running trials, at once
    first.wait()
    before = {t.number: t for t in _trials(tmp_path)}
    done_before = {t.user_attrs["run"] for t in before.values() if t.state == TrialState.COMPLETE}
    cut = [t for t in before.values() if t.state == TrialState.RUNNING]
    assert cut                                                 # (the next trial starts as soon as one ends)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    cut_runs = len(_children(client, load_config(TINY).tracking.experiment)[1]) - len(done_before)
    assert 0 <= cut_runs <= len(cut)                           # (a trial killed before its run was made has none)

    second = _tune(tmp_path, prefect_api)
    out, _ = second.communicate(timeout=600)
    assert second.returncode == 0, out[-3000:]
    trials = _trials(tmp_path)
    finished = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(finished) == TRIALS, [(t.number, t.state, t.user_attrs) for t in trials]
    runs = [t.user_attrs["run"] for t in finished]
    assert len(set(runs)) == TRIALS and done_before <= set(runs)               # none repeated
    for t in cut:                                              # a trial cut by the kill: run again, same values
        again = [x for x in finished if x.user_attrs.get("resumes") == t.number]
        assert len(again) == 1
        if t.params:               # (a trial killed before its values were drawn has none to repeat: it draws anew)
            assert again[0].params == t.params and again[0].user_attrs["run"] == t.user_attrs["run"]
    values = [t.value for t in finished]
    best = max(finished, key=lambda t: t.value)
    assert best.value > min(values)                           # better than the worst learning rate tried
    assert f"best: trial {best.number} ({best.user_attrs['run']})" in out

    cfg = load_config(tmp_path / "tune" / "best.yaml")         # ready for `rlflow run`
    assert cfg.train.lr == pytest.approx(best.params["train.lr"]) and cfg.run.iterations == 8

    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    assert exp.tags.get("mlflow.experimentKind") == "custom_model_development"     # (made by the tune first)
    parent, children = _children(client, cfg.tracking.experiment)
    assert parent.info.status == "FINISHED"
    # one MLflow run per trial, nested: the trial's rlflow run itself (its config, its metrics), a cut one resumed
    assert sorted(c.info.run_name for c in children) == sorted(runs)
    every = client.search_runs([exp.experiment_id])
    assert {r.info.run_id for r in every} == {parent.info.run_id} | {c.info.run_id for c in children}
    for c in children:
        assert c.info.status == "FINISHED" and c.data.tags["rlflow.run"] == c.info.run_name
        assert float(c.data.params["train.lr"]) == pytest.approx(
            next(t.params["train.lr"] for t in finished if t.user_attrs["run"] == c.info.run_name))
        history = client.get_metric_history(c.info.run_id, "reward/mean")
        assert sorted(m.step for m in history) == list(range(1, 9))                 # once per iteration
        assert "tune/value" in c.data.metrics
    assert parent.data.metrics["best_value"] == pytest.approx(best.value)

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as prefect:
        artifacts = [a for a in prefect.read_artifacts() if a.key == "tune-tiny-demo-tune"]
    assert artifacts and artifacts[0].type == "table"


def test_a_trial_is_done_in_the_study_only_after_its_mlflow_run_has_its_value(tmp_path, prefect_api, monkeypatch):
    """The order that makes a kill at any moment safe: the trial's MLflow run gets its value and state first, the
    study's verdict comes last; a kill between the two (here: the tracker's end raising) leaves the trial running
    in the study, and the next tune runs it again with its values."""
    import argparse

    from optuna.trial import TrialState

    from flows.tune import Tune
    from flows.tune_space import load_space

    monkeypatch.setenv("PREFECT_API_URL", prefect_api)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-4, high: 1.0e-2}\n")
    overrides = ["run.iterations=1", f"store.uri=file://{tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    args = argparse.Namespace(config=str(TINY), override=overrides, out=str(tmp_path / "tune"), study="order",
                              storage=None, direction="maximize", pruner="none", window=1, seed=0, sampler="random",
                              metric="reward/mean", trials=1, parallel=1)
    space = load_space(str(tmp_path / "space.yaml"), str(TINY), overrides)
    tune = Tune(args, load_config(TINY, overrides), space)
    study = tune.study()
    seen = []

    class Killed(BaseException):
        pass

    class Tracker:
        def child(self, number, name, store_root):
            return "run-id"

        def end(self, run_id, state, value):
            seen.append((state, value, study.get_trials(deepcopy=False)[0].state))
            raise Killed

    with pytest.raises(Killed):
        tune.run_trial(study, study.ask(), Tracker())
    [(state, value, in_study)] = seen
    assert state == "COMPLETE" and value is not None and in_study == TrialState.RUNNING
    assert tune.resume(study) == 1                              # run again by the next tune, with its values
    [cut] = study.get_trials(deepcopy=False, states=(TrialState.FAIL,))
    again = study.ask()
    assert again.user_attrs["resumes"] == cut.number and {k: p.suggest(again) for k, p in space.items()} == cut.params


def test_a_bound_written_without_a_dot_is_the_number_the_config_takes(tmp_path):
    """`low: 1e-5` is a string to YAML 1.1 (no dot), and a number to the config's own fields (train.lr: 1e-5):
    the space takes it as that number too (was: 'needs numeric low and high'); text that is no number is still
    refused in one line."""
    from flows.tune_space import load_space
    from tasks.core.errors import UserError

    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1e-5, high: 1e-2}\n")
    lr = load_space(str(tmp_path / "space.yaml"), str(TINY), [])["train.lr"]
    assert (lr.low, lr.high) == (1e-5, 1e-2)
    (tmp_path / "space.yaml").write_text("train.lr: {type: uniform, low: small, high: 1e-2}\n")
    with pytest.raises(UserError, match="needs numeric low and high, got low='small'"):
        load_space(str(tmp_path / "space.yaml"), str(TINY), [])


def test_the_base_runs_own_store_state_does_not_refuse_a_tune(tmp_path, prefect_api):
    """Before any trial the tune asks what `rlflow run` refuses of the base config, under a run name no trial has:
    the base run's v0, made by a warm start at other settings, is not a trial's (each trial makes its own), so a
    tune of warmup.lr is not refused as a resume with changed values (it was, by the base run's name)."""
    demos = tmp_path / "demos.jsonl"
    demos.write_text('{"messages": [{"role": "user", "content": "a="}, {"role": "assistant", "content": "bbb"}]}\n')
    sets = [f"warmup={{path: {demos}}}", f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    env = {**{k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}, "PREFECT_API_URL": prefect_api}
    made = subprocess.run([sys.executable, "-m", "flows.cli", "sft", str(TINY), *(a for s in sets for a in ("-o", s))],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-4, high: 1.0e-2}\n")
    # reached (no trial run), with nothing left by the preflight for the trials: DS_ACCELERATOR, a reward worker
    code = ("import os, sys, flows.tune\nfrom tasks.core.processes import descendants\n"
            "flows.tune.tune_flow = lambda *a: sys.exit(42 if 'DS_ACCELERATOR' not in os.environ and not "
            "descendants(os.getpid()) else 43)\nfrom flows.cli import main\nsys.exit(main())")
    argv = ["tune", str(TINY), "--space", str(tmp_path / "space.yaml"), "--trials", "1", "--out",
            str(tmp_path / "tune"), *(a for s in [*sets, "warmup.lr=0.002"] for a in ("-o", s))]
    tune = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert tune.returncode == 42, tune.stderr[-2000:]


def test_a_window_the_runs_never_fill_is_warned_of():
    """--window >= run.iterations with the median pruner: no trial of the base run's length is ever pruned (the
    pruner waits WINDOW steps), said before any trial; a window the run fills, or no pruner, is not."""
    import argparse

    from flows.tune_space import window_warning

    cfg = load_config(TINY, ["run.iterations=4"])
    for window, pruner, said in ((4, "median", True), (3, "median", False), (9, "none", False)):
        line = window_warning(argparse.Namespace(metric="reward/mean", window=window, pruner=pruner), cfg) or ""
        assert line.startswith("warning: --window 4 with run.iterations 4: the median pruner waits 4 iterations, so "
                               "no trial is ever pruned") == said, line


def test_a_study_resumed_with_another_metric_direction_or_space_is_refused(tmp_path, monkeypatch):
    """A study started on one space and metric, resumed with `--metric reward/meen` (a typo) or another space,
    ran and printed its old best labelled with the new metric and space. The study keeps what it was started
    with; a resume that differs is refused, one line, before any trial."""
    import argparse

    from flows.tune import Tune
    from flows.tune_space import check_study, load_space
    from tasks.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-4, high: 1.0e-2}\n")
    (tmp_path / "other.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-4, high: 1.0e-2}\n"
                                         "train.beta: {type: uniform, low: 0.0, high: 0.1}\n")
    overrides = [f"store.uri=file://{tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/m.db"]
    args = argparse.Namespace(config=str(TINY), override=overrides, out=str(tmp_path / "tune"), study="kept",
                              storage=None, direction="maximize", pruner="none", window=1, seed=0, sampler="random",
                              metric="reward/mean", trials=1, parallel=1)
    cfg = load_config(TINY, overrides)
    space = load_space(str(tmp_path / "space.yaml"), str(TINY), overrides)
    Tune(args, cfg, space).study()
    check_study(args, cfg, space)                                  # (the same: resumed)
    for change, match in ((dict(metric="reward/meen"), "--metric: .* was started with reward/mean, not reward/meen"),
                          (dict(direction="minimize"), "--direction: .* started with maximize, not minimize"),
                          (dict(space="other.yaml"), "--space: .* started with train.lr, not train.beta, train.lr")):
        other = argparse.Namespace(**{**vars(args), **{k: v for k, v in change.items() if k != "space"}})
        resumed = load_space(str(tmp_path / change.get("space", "space.yaml")), str(TINY), overrides)
        with pytest.raises(UserError, match=match):
            check_study(other, cfg, resumed)


def test_a_metric_no_iteration_logs_stops_the_first_trial_early(tmp_path, prefect_api):
    """A misspelled reward/ or train/ metric was found only when the first trial's run completed (a real trial
    can last hours); each iteration logs those, so one unseen after a few iterations stops the trial and ends the
    tune, one line, exit 2."""
    (tmp_path / "space.yaml").write_text("train.lr: {type: log_uniform, low: 1.0e-4, high: 1.0e-2}\n")
    argv = [sys.executable, "-m", "flows.cli", "tune", str(TINY), "--space", str(tmp_path / "space.yaml"),
            "--trials", "2", "--metric", "reward/meen", "--out", str(tmp_path / "tune"),
            "-o", "run.iterations=400", "-o", f"store.uri=file://{tmp_path}/store",
            "-o", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    out = subprocess.run(argv, cwd=tmp_path, env={**os.environ, "PREFECT_API_URL": prefect_api},
                         capture_output=True, text=True, timeout=600)
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and last.startswith("error: --metric: reward/meen: the trial's run logs no such "
                                                   "metric; did you mean reward/mean?"), out.stderr[-2000:]
    assert len(_trials(tmp_path)) == 1
    iterations = list((tmp_path / "store").glob("*/iter-*"))
    assert 0 < len(iterations) < 100, iterations                # (stopped early, not after 400 iterations)


def test_a_key_is_refused_as_ignored_only_where_every_corner_ignores_it_itself(tmp_path):
    """A tuned key another key's warning names as its reason (lora_r 0 makes a set lora_alpha have no effect) is
    read, and so is another learner's setting where train.algorithm is tuned too: refused before as ignored. One
    the config ignores at every corner (gamma under grpo alone) is refused."""
    from flows.tune_space import load_space
    from tasks.core.errors import UserError

    spaces = {"lora": "train.lora_r: {type: categorical, choices: [0, 8]}\n",
              "gamma_with_ppo": "train.learner.gamma: {type: uniform, low: 0.9, high: 1.0}\n"
                                "train.algorithm: {type: categorical, choices: [grpo, ppo]}\n",
              "gamma": "train.learner.gamma: {type: uniform, low: 0.9, high: 1.0}\n"}
    for name, text in spaces.items():
        (tmp_path / f"{name}.yaml").write_text(text)
    assert list(load_space(str(tmp_path / "lora.yaml"), str(TINY), ["train.lora_alpha=32"])) == ["train.lora_r"]
    assert list(load_space(str(tmp_path / "gamma_with_ppo.yaml"), str(TINY), [])) == ["train.learner.gamma",
                                                                                     "train.algorithm"]
    with pytest.raises(UserError, match=r"--space: train.learner.gamma: the config ignores it \(train.learner.gamma "
                                        r"is a setting of ppo, vtrace_awr; train.algorithm is grpo: ignored\)"):
        load_space(str(tmp_path / "gamma.yaml"), str(TINY), [])

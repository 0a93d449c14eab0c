"""`rlflow tune CONFIG --space SPACE.yaml --trials N --parallel K`: Optuna over a search space of config keys,
each trial a real rlflow run (docs/operations.md#tuning: SPACE.yaml maps config keys to distributions).
The space is checked before any trial starts (one line, exit 2). Each trial is `rlflow run` in a process of
its own, K at a time, and reports its metric to Optuna after each iteration (the pruner stops unpromising
ones); the study lives in a database (`--storage`), so a killed tune, run again, goes on; MLflow has one
parent run for the study with each trial's run nested under it; the best config is written as YAML (`--out`).
More: docs/internals.md (flows/tune.py): checks, trials, pruning, resuming and MLflow, in full.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from flows.tune_space import Param, not_set_by, out_folder, override_of, storage_url, study_name, window_warning
from tasks.core import layout
from tasks.core.config import Config, load_config

POLL_SECONDS = 1.0
TAG_STUDY = "rlflow.tune.study"


LAG = 2            # iterations a train or evaluation metric may land after its iteration's rewards and be read


def _manifest(store, key: str) -> dict | None:
    try:
        return store.manifest(key)
    except Exception:  # noqa: BLE001 - unreadable now (a store's passing error): asked again at the next poll
        return None


def _logged(store, run: str, iteration: int) -> Iterator[dict]:
    """The metrics of one iteration's reward, train and evaluation manifests (what a trial is judged by), each
    read when asked for."""
    for key in (layout.rewards(run, iteration), layout.checkpoint(run, iteration), layout.evaluation(run, iteration)):
        yield (_manifest(store, key) or {}).get("meta", {}).get("metrics", {})


def iteration_metric(store, run: str, iteration: int, metric: str) -> float | None:
    """The metric of one iteration, from its reward, train or evaluation manifest (None: not there)."""
    for metrics in _logged(store, run, iteration):
        value = metrics.get(metric)
        if value is not None:
            return float(value)
    return None


def _unlogged(store, run: str, iteration: int, metric: str, stopped: bool = False) -> str:
    """What a trial whose run completed (or was stopped: `stopped`) without `metric` says: the metrics its last
    iteration did log (the one `metric` is a slip of first)."""
    if (meant := misspelled(store, run, iteration, metric)) is not None:
        return (f"--metric: {metric}: the trial's run logs no such metric; did you mean {meant}? (its iteration "
                f"{iteration} logged it)")
    logged = sorted({k for metrics in _logged(store, run, iteration) for k in metrics})
    how = f"logged no such metric in its first {iteration} iterations" if stopped else "completed without logging it"
    return (f"--metric: {metric}: the trial's run {how}; its iteration {iteration} logged "
            f"{', '.join(logged[:40])}{' ...' if len(logged) > 40 else ''}; expected one of those")


def misspelled(store, run: str, scored: int, metric: str) -> str | None:
    """The logged name `metric` is a slip of (difflib: at least 0.85 alike), when its trial's last iterations
    logged that name and not `metric`: a typo said after the first iteration, not after several or the run's end.
    A function's mean counts as logged where its errors are (an iteration where it scored nothing has none)."""
    import difflib
    import re

    if scored < 1:
        return None
    known: set[str] = set()
    for it in range(max(1, scored - LAG), scored + 1):
        for metrics in _logged(store, run, it):
            known |= set(metrics)
    known |= {f"{m.group(1)}/mean" for k in known if (m := re.fullmatch(r"(.+)/errors", k))}
    if metric in known:
        return None
    close = difflib.get_close_matches(metric, sorted(known), n=1, cutoff=0.85)
    return close[0] if close else None


def window_mean(values: dict[int, float], window: int) -> float:
    """The trial's value so far: the mean of its last `window` iterations that have the metric."""
    return statistics.fmean([values[i] for i in sorted(values)[-window:]])


def run_name(base: str, params: dict) -> str:
    digest = hashlib.sha1(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]
    return f"{base}-{digest}"[:100]


class Tune:
    def __init__(self, args, cfg: Config, space: dict[str, Param]):
        self.args, self.cfg, self.space = args, cfg, space
        self.out = out_folder(args, cfg)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "trials").mkdir(exist_ok=True)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.procs: dict[int, subprocess.Popen] = {}
        self.unlogged: str | None = None     # a trial's run completed without logging --metric: said, and the end

    def study_name(self) -> str:
        return study_name(self.args, self.cfg)

    # ------------------------------------------------------------------------------------ study

    def study(self):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = storage_url(self.args, self.out)
        pruner = (optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=self.args.window)
                  if self.args.pruner == "median" else optuna.pruners.NopPruner())
        from sqlalchemy.exc import SQLAlchemyError

        for attempt in range(5):
            # Two processes opening a new sqlite study at once (the tune and anyone reading it, e.g. optuna-
            # dashboard) both stamp its schema version, and one gets a UNIQUE-constraint error: the schema is
            # there by then, so opening it again succeeds.
            try:
                study = optuna.create_study(study_name=self.study_name(), storage=storage, pruner=pruner,
                                            direction=self.args.direction, load_if_exists=True)
                break
            except SQLAlchemyError:
                if attempt == 4:
                    raise
                time.sleep(0.5 * (attempt + 1))
        if "metric" not in study.user_attrs:       # (what a resume is checked against: check_study)
            study.set_user_attr("metric", self.args.metric)
            study.set_user_attr("space", sorted(self.space))
        # a resumed study's sampler goes on from where it was, not from the seed's first draws again (those are
        # its finished trials' values: they would come back as the same runs)
        seed = self.args.seed + len(study.get_trials(deepcopy=False))
        study.sampler = (optuna.samplers.TPESampler(seed=seed) if self.args.sampler == "tpe"
                         else optuna.samplers.RandomSampler(seed=seed))
        return study

    def resume(self, study) -> int:
        """Trials a killed tune left running are run again with their values; how many are left to start."""
        from optuna.trial import TrialState

        for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            study.enqueue_trial(t.params, user_attrs={"resumes": t.number})
            study.tell(t.number, state=TrialState.FAIL)        # (no "error": interrupted, not failed)
        ended = [t for t in study.get_trials(deepcopy=False)
                 if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
                 or (t.state == TrialState.FAIL and "error" in t.user_attrs)]
        return max(self.args.trials - len(ended), 0)

    # ------------------------------------------------------------------------------------ trials

    def run_trial(self, study, trial, tracker) -> None:
        from optuna.trial import TrialState

        from tasks.core.store import Store

        params = {k: p.suggest(trial) for k, p in self.space.items()}
        name = run_name(self.cfg.run.name, params)
        trial.set_user_attr("run", name)
        store, pruned, missing = Store.open(self.cfg.store), False, False
        child = tracker.child(trial.number, name, store.root)
        given = not_set_by(self.args.override, [*params, "run.name"])        # (the trial's own win)
        argv = [sys.executable, "-c", "import sys; from flows.cli import main; sys.exit(main())", "run",
                self.args.config, *[a for o in given for a in ("-o", o)],
                *[a for k, v in params.items() for a in ("-o", override_of(k, v))], "-o", f"run.name={name}",
                "--summary-json", str(self.out / "trials" / f"{name}.json")]
        from tasks.scoring.worker import die_with_parent

        log_path = self.out / "trials" / f"{trial.number:04d}-{name}.log"
        log = open(log_path, "w")
        from tasks.core.processes import spawn

        proc = spawn(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, rlflow=True,
                     preexec_fn=die_with_parent)        # (-c, not -m: told it runs rlflow's, so it gets its path)
        with self.lock:
            self.procs[trial.number] = proc
        values: dict[int, float] = {}            # iteration -> metric
        scored = 0                               # iterations with rewards (retention keeps those, not checkpoints)
        unseen = 1                               # the first iteration not looked at yet
        try:
            while True:
                ended = proc.poll() is not None
                while _manifest(store, layout.rewards(name, scored + 1)) is not None:
                    scored += 1
                # every new iteration, and the newest again (train and evaluation metrics land after the rewards)
                for it in range(min(unseen, max(1, scored - LAG)), scored + 1):
                    if it in values or (v := iteration_metric(store, name, it, self.args.metric)) is None or \
                            not math.isfinite(v):           # (an iteration nothing scored: no value, not a 0)
                        continue
                    values[it] = v
                    trial.report(window_mean(values, self.args.window), it)
                    if not pruned and not ended and trial.should_prune():
                        pruned = True
                        proc.send_signal(signal.SIGTERM)
                unseen = scored + 1
                if not values and not ended and not missing and (scored > 2 * LAG and self.args.metric.split(
                        "/", 1)[0] in ("reward", "train") or misspelled(store, name, scored, self.args.metric)):
                    missing = True      # (each iteration logs its reward and train metrics: not one is a name no
                    proc.send_signal(signal.SIGTERM)      # run logs; said now, not after the trial's last iteration)
                if ended or self.stop.wait(POLL_SECONDS):
                    break
            code = proc.wait()
        finally:
            log.close()
            with self.lock:
                self.procs.pop(trial.number, None)
        if self.stop.is_set() and not pruned:
            return                                   # left running in the study: the next tune resumes it
        # the trial's MLflow run first, the study's verdict last: a kill between the two leaves the trial running in
        # the study, so the next tune runs it again (its run already done) rather than leave a run without its value
        if pruned:
            state, value, verdict = "PRUNED", None, {"state": TrialState.PRUNED}
        elif code == 0 and values:
            value = window_mean(values, self.args.window)
            state, verdict = "COMPLETE", {"values": value}
        else:
            state, value, verdict = "FAILED", None, {"state": TrialState.FAIL}
        tracker.end(child, state, value)
        unlogged = _unlogged(store, name, scored, self.args.metric, missing) \
            if (code == 0 or missing) and not values and not pruned else None
        with self.lock:
            if state == "FAILED":
                trial.set_user_attr("error", unlogged or _last_line(log_path))
            study.tell(trial, **verdict)
        if unlogged:             # (every trial would end so: the study stops, said in one line)
            self.unlogged = unlogged
            self.terminate()
        print(f"trial {trial.number:>3}  {state:<8} {'' if value is None else f'{value:.4f}':>8}  {name}  "
              + "  ".join(f"{k}={v}" for k, v in params.items()), flush=True)

    def worker(self, study, left: list[int], tracker) -> None:
        while not self.stop.is_set():
            with self.lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
                trial = study.ask()
            self.run_trial(study, trial, tracker)

    def terminate(self) -> None:
        self.stop.set()
        with self.lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    # ------------------------------------------------------------------------------------ the end

    def best(self, study) -> dict | None:
        from optuna.trial import TrialState

        from tasks.core.config_yaml import dump_yaml

        done = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
        if not done:
            return None
        best = study.best_trial
        cfg = load_config(self.args.config, [*self.args.override,
                                             *[override_of(k, v) for k, v in best.params.items()]])
        data = cfg.model_dump(mode="json")
        data["run"]["name"] = f"{self.cfg.run.name}-best"
        path = self.out / "best.yaml"
        tmp = path.with_suffix(".yaml.tmp")
        tmp.write_text(f"# rlflow tune {self.study_name()}: trial {best.number} ({best.user_attrs.get('run')}), "
                       f"{self.args.metric} {best.value:.6g}\n# {json.dumps(best.params)}\n"
                       + dump_yaml(data))
        os.replace(tmp, path)
        return {"trial": best.number, "value": best.value, "params": best.params, "run": best.user_attrs.get("run"),
                "config": str(path)}

    def rows(self, study) -> list[dict]:
        return [{"trial": t.number, "state": t.state.name, "value": t.value, "run": t.user_attrs.get("run"),
                 **{k: t.params.get(k) for k in self.space}} for t in study.get_trials(deepcopy=False)]


class StudyTracker:
    """The study's MLflow parent run, and each trial's rlflow run nested under it (MlflowClient: no active-run
    globals across threads)."""

    def __init__(self, cfg: Config, study: str, space: dict[str, Param], metric: str):
        from tasks.core.tracking import experiment_id
        from tasks.core.tracking_db import tracking_client

        self.client = tracking_client(cfg.tracking.uri)
        self.exp = experiment_id(self.client, cfg)
        found = self.client.search_runs([self.exp], f"tags.`{TAG_STUDY}` = '{study}'", max_results=1)
        if found:                              # a resumed tune: its children a kill left running are over
            self.parent = found[0].info.run_id
            self.client.update_run(self.parent, status="RUNNING")
            for child in self.client.search_runs([self.exp], f"tags.`mlflow.parentRunId` = '{self.parent}' "
                                                 f"and attributes.status = 'RUNNING'"):
                self.client.set_terminated(child.info.run_id, "KILLED")
        else:
            run = self.client.create_run(self.exp, run_name=f"tune {study}", tags={TAG_STUDY: study})
            self.parent = run.info.run_id
            for key, p in space.items():
                bounds = {"choices": list(p.choices)} if p.choices else {"low": p.low, "high": p.high}
                self.client.log_param(self.parent, f"space.{key}", json.dumps({"type": p.kind, **bounds}))
            self.client.log_param(self.parent, "metric", metric)
        self.lock = threading.Lock()

    def child(self, number: int, name: str, store_root: str) -> str:
        """The trial's MLflow run, nested under the study's: the run its rlflow run logs into (tasks/core/tracking.py
        finds a run by its `rlflow.run` and `rlflow.store` tags), made here first so that it has its parent from
        the start; a resumed trial's run is found again."""
        from tasks.core.tracking import TAG_RUN, TAG_STORE

        tags = {"mlflow.parentRunId": self.parent, "rlflow.tune.trial": str(number)}
        with self.lock:
            found = self.client.search_runs(
                [self.exp], f"tags.`{TAG_RUN}` = '{name}' and tags.`{TAG_STORE}` = '{store_root}'", max_results=1,
                order_by=["attributes.start_time DESC"])
            if found:
                for k, v in tags.items():
                    self.client.set_tag(found[0].info.run_id, k, v)
                return found[0].info.run_id
            return self.client.create_run(self.exp, run_name=name,
                                          tags={**tags, TAG_RUN: name, TAG_STORE: store_root}).info.run_id

    def end(self, run_id: str, state: str, value: float | None) -> None:
        with self.lock:
            if value is not None:         # (the trial's own metrics are its rlflow run's)
                self.client.log_metric(run_id, "tune/value", value)
            self.client.set_terminated(run_id, {"COMPLETE": "FINISHED", "PRUNED": "KILLED"}.get(state, "FAILED"))

    def end_study(self, best: dict | None, status: str) -> None:
        with self.lock:
            if best is not None:
                self.client.log_metric(self.parent, "best_value", best["value"])
                self.client.set_tag(self.parent, "best_run", best["run"])
                self.client.log_artifact(self.parent, best["config"])
            self.client.set_terminated(self.parent, status)


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def tune_flow(args, cfg: Config, space: dict[str, Param]) -> dict:
    from prefect import flow
    from prefect.artifacts import create_table_artifact

    if (said := window_warning(args, cfg)) is not None:     # (said here, after every check that refuses)
        print(said, file=sys.stderr)

    @flow(name="rlflow-tune", flow_run_name=f"tune {study_name(args, cfg)}", log_prints=False)
    def body() -> dict:
        tune = Tune(args, cfg, space)
        study = tune.study()
        left = [tune.resume(study)]
        tracker = StudyTracker(cfg, tune.study_name(), space, args.metric)
        print(f"study {tune.study_name()}: {left[0]} trial(s) to run, {args.parallel} at a time "
              f"({tune.out}/study.db unless --storage)", flush=True)
        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        stopped: list[int] = []

        def on_signal(signum, frame):
            stopped.append(signum)
            tune.terminate()
        for s in previous:
            signal.signal(s, on_signal)
        try:
            threads = [threading.Thread(target=tune.worker, args=(study, left, tracker), daemon=True)
                       for _ in range(args.parallel)]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.5)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        best = tune.best(study)
        rows = tune.rows(study)
        create_table_artifact(table=rows, key=f"tune-{_slug(tune.study_name())}",
                              description=f"rlflow tune {tune.study_name()}: {args.metric}, {args.direction}")
        tracker.end_study(best, "KILLED" if stopped or tune.unlogged else "FINISHED")
        return {"best": best, "trials": rows, "stopped": stopped[0] if stopped else None, "unlogged": tune.unlogged}
    return body()


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")[:60] or "study"

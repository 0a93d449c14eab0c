"""`rlflow` — the command line.

    rlflow run CONFIG [-o key=value]... [--summary-json PATH]
    rlflow export CONFIG VERSION DEST [--format gguf --quant q8_0] [--register]   # a policy as a folder or a GGUF
    rlflow plan CONFIG [-o key=value]...      # run's preflight, then every role's machines, counts, USD/hour
    rlflow sft CONFIG [-o key=value]...       # the warm start alone (warmup:): SFT, published as the run's v0
    rlflow record CONFIG --policy MODULE:FN|model --out FILE   # demonstrations from a policy in the environment
    rlflow tune CONFIG --space SPACE.yaml --trials N [--parallel K]   # Optuna over config keys, a run per trial

Exit codes: 0 success; 2 a user error (one line on stderr naming the field or row); 1 an internal error;
130 / 143 stopped by SIGINT (Ctrl-C) / SIGTERM.
Prefect: a temporary API server the run starts and stops, unless PREFECT_API_URL names one (its UI shows the run).
Ctrl-C or SIGTERM stops the run where it is, saying what is kept and how to resume (docs/internals.md: stopping).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

from flows.export import cmd_export
from tasks.core.errors import UserError
from tasks.core.paths import check_environment, check_path, working_directory_on_path
from tasks.core.process_wide import USER_THREADS, exit_now, exit_wound_down, set_default, set_variable
from tasks.core.processes import end_children, how_it_ended


def _command_process() -> None:
    """What a command that runs the user's config sets up in its process: our progress lines are the console
    output (Prefect's logs still reach its API/UI unless verbose; MLflow's, transformers' and the hub's quieted),
    and the working directory is importable (the user's reward functions, environments and scripted policies)."""
    if not os.environ.get("RLFLOW_VERBOSE"):
        set_default("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
        set_default("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "CRITICAL")
        set_default("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "CRITICAL")
    import logging

    set_default("MLFLOW_LOGGING_LEVEL", "WARNING")      # (its database creation is two INFO lines)
    set_default("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")    # (we print the run's URL once)
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    set_default("TOKENIZERS_PARALLELISM", "false")
    set_default("PREFECT_SERVER_ANALYTICS_ENABLED", "false")    # (its telemetry errors offline)
    set_default("TRANSFORMERS_VERBOSITY", "error")
    set_default("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    working_directory_on_path()         # (user modules are found there, rlflow's own packages before it)
    check_environment()                 # ($RLFLOW_IMPORT_SECONDS, ..._USER_OUTPUT_BYTES, ..._CACHE)


def checked_config(args):
    """The config of `rlflow run` / `rlflow plan`, through the one preflight both share (flows/preflight.py:
    everything `rlflow run` checks before it starts Prefect's server, takes the lease or writes a byte): a
    config run refuses, plan refuses with the same line. Returns (cfg, overrides)."""
    from tasks.core.config import load_config
    from tasks.core.stage import given_overrides

    overrides = given_overrides(args)
    cfg = load_config(args.config, overrides)       # a bad config is one line and exit 2, before Prefect starts
    _command_process()
    if cfg.train.engine != "deepspeed":   # (accelerate imports deepspeed to unwrap a model; it would warn)
        set_default("DS_ACCELERATOR", "cpu")
    from flows.preflight import preflight

    preflight(cfg)                  # every input mistake, before Prefect's server starts (the flow checks again)
    return cfg, overrides


def cmd_run(args) -> int:
    if args.summary_json:
        check_path("--summary-json", args.summary_json, "file")
    cfg, overrides = checked_config(args)
    from flows.training import eval_label, train_flow

    if not os.environ.get("PREFECT_API_URL"):
        _shield_prefect_server()    # (imports Prefect's server, ~3 s: only for the temporary one)
        print("starting Prefect's temporary API server (no PREFECT_API_URL set; ~5-15 s, once per run)",
              file=sys.stderr, flush=True)

    _run_cfg.append(cfg)
    summary = train_flow(args.config, overrides)
    _finished.append(SUMMARY)       # the run's result is complete: a stop from here on is not an interruption
    public = {k: summary[k] for k in ("run", "iterations_completed", "reward_mean", "policy_uri", "mlflow_run_id",
                                      "held_out")}
    public["reward_mean"] = [v if math.isfinite(v) else None for v in public["reward_mean"]]  # (JSON: no NaN)
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(public, indent=2))
    scored = [v for v in summary["reward_mean"] if math.isfinite(v)]     # (an iteration nothing scored: no mean)
    print(f"\ndone: {summary['iterations_completed']} iterations, mean reward "
          + (f"{scored[0]:.3f} -> {scored[-1]:.3f}" if scored else "n/a (no iteration scored)"))
    print(f"  MLflow run:       {summary['mlflow']}")          # (a server: its metric charts)
    if summary.get("mlflow_runs"):
        print(f"  MLflow runs:      {summary['mlflow_runs']}")     # (the runs list, reward/eval columns)
    if summary.get("mlflow_view"):
        print(f"  view it with:     {summary['mlflow_view']}")     # (a database or folder: from any directory)
    if summary.get("mlflow_traces"):
        print(f"  episodes:         {summary['mlflow_traces']}")   # (MLflow traces: spans, rewards as feedback)
    print(f"  published policy: {summary['policy_uri']}" +
          (f" (model version {summary['model_version']})" if summary.get("model_version") else ""))
    if summary.get("best_policy"):
        print(f"  best (eval):      {summary['best_policy']}")
    held = {k: v for k, v in (summary.get("held_out") or {}).items() if k != "metric"}
    if held:
        print(f"  {eval_label(cfg)} {summary['held_out']['metric']}: "
              + ", ".join(f"{('v0' if cfg.warmup is not None else 'base') if k == '0' else 'v' + k} {v:.3f}"
                          for k, v in held.items()))       # (v0 after a warm start is no base model)
    if summary.get("cost_usd"):
        print(f"  cost:             {summary['cost_usd']:.4f} USD")
    print(f"  reward curve:     {summary['reward_curve']}")
    return 0


def cmd_plan(args) -> int:
    cfg, _ = checked_config(args)              # what `rlflow run` would refuse, refused here with the same line
    from flows.plan import plan

    print(plan(cfg, args.config))
    return 0


def cmd_sft(args) -> int:
    from flows.warmup import sft_command

    return sft_command(checked_config(args)[0])     # (the warm start's checks are part of the preflight)


def cmd_record(args) -> int:
    from flows.warmup import record_command
    from tasks.core.config import load_config
    from tasks.core.stage import given_overrides

    check_path("--out", args.out, "file", replaces=True)       # (written beside it, then renamed)
    cfg = load_config(args.config, given_overrides(args))
    _command_process()
    return record_command(args, cfg)


STOP_GRACE_SECONDS = 10.0
_stopped_by: list[int] = []
_run_cfg: list = []              # the run's config (what an interrupted run reads its newest policy from)
# After the flow returned (the run's result complete: store, MLflow run, its end), what this process is still
# doing; a stop signal then ends it with exit code 0 and says what was left undone (_stop_after_done).
_finished: list[str] = []
SUMMARY = "printing the summary"
LAST_LOGS = "sending the flow's last logs and events to Prefect's API (its UI may lack them)"
EXITING = "nothing (only this process's own exit)"


def _stop_on_signals() -> None:
    """SIGINT and SIGTERM stop the run: no stage starts or is retried after it (tasks/core/stage.py: STOP) and
    a KeyboardInterrupt is raised where the main thread is; also where SIGINT came in ignored (a background job
    of a script). A second signal, or STOP_GRACE_SECONDS without an exit, ends it by force.

    While a flow runs, Prefect has SIGTERM raise its TerminationSignal instead (capture_sigterm), and sends the
    signal again to the handler it replaced once that has unwound its engine. It does not always unwind: a
    TerminationSignal that lands while a task run is being created turns into Prefect's own ValueError ("Task
    run is not set"), and the signal is never sent again. So the stop is noted when Prefect's handler runs,
    and the signal it sends again is not taken for a second one."""
    from prefect.utilities import engine as prefect_engine

    from tasks.core.stage import STOP

    resent = []                  # a stop noted in Prefect's handler, whose signal Prefect will send again

    def note(signum) -> None:
        _stopped_by.append(signum)
        STOP.set()
        if len(_stopped_by) > 1:
            _exit_now("stopped by a second signal")
        _say(f"\ninterrupted at {_where()}: stopping (no stage starts after this one; what it had not committed "
             f"is redone when the run resumes)\n")
        timer = threading.Timer(STOP_GRACE_SECONDS, _exit_now,
                                args=(f"the run did not stop within {STOP_GRACE_SECONDS:g} s; ended it",))
        timer.daemon = True
        timer.start()

    def on_signal(signum, _frame):
        if _finished:
            _stop_after_done(signum)
            return
        if resent:
            resent.clear()
        else:
            note(signum)
        raise KeyboardInterrupt

    prefects = prefect_engine._prefect_sigterm_handler
    if not getattr(prefects, "_rlflow", False):
        def noted(signum, *args):
            note(signum)
            resent.append(signum)
            prefects(signum, *args)              # (raises Prefect's TerminationSignal)
        noted._rlflow = True
        prefect_engine._prefect_sigterm_handler = noted

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def _exit_now(why: str) -> None:
    """End this process and every process it started, at once (what a kill would do; the store never shows
    what was not committed)."""
    print(f"\nrlflow: {why} (run the same command to resume)", file=sys.stderr, flush=True)
    _end_children(signal.SIGKILL)
    exit_now(128 + (_stopped_by[0] if _stopped_by else signal.SIGINT))


def _end_children(sig: int) -> None:
    from tasks.core.processes import descendants

    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _say(text: str) -> None:
    """A line on stderr from a signal handler: one write(2), no buffer that the interrupted code may hold."""
    try:
        sys.stdout.flush()           # (what was printed before the signal comes first)
    except (RuntimeError, ValueError, OSError):
        pass                         # (the handler interrupted a write to stdout: that line comes later)
    os.write(2, text.encode())


def _where() -> str:
    """Where the flow's loop is (flows/training.py: NOW); read without importing (safe in a signal handler)."""
    now = getattr(sys.modules.get("flows.training"), "NOW", None)
    return f"iteration {now['iteration']} ({now['stage']})" if now else "start-up"


def _kept() -> str:
    """What the stopped run keeps: its newest published policy, read from the store."""
    if not _run_cfg:
        return "nothing of the run had started"
    try:
        from tasks.core import layout
        from tasks.core.store import open_store

        cfg = _run_cfg[0]
        store = open_store(cfg)
        latest = store.get_pointer(layout.latest(cfg.run.name, "policy"))
    except Exception as e:  # noqa: BLE001 - the stop's own message must not fail
        return f"every committed output is kept (the store could not be read now: {type(e).__name__})"
    if latest is None:
        return "every committed output is kept (no policy published yet)"
    return f"every committed output is kept, the newest policy {store.uri(latest)}"


def _interrupted() -> int:
    """After a stop signal has unwound the flow (its run ended, lease released; the resident trainer's full
    checkpoint written): stop what this process started and still runs, say what is kept and how to resume (the
    "interrupted at" line came at the signal: note), exit at once (threads of stages of later iterations
    included: what they had not committed is not visible, and the resumed run redoes it)."""
    print(f"stopped: {_kept()}; run the same command to resume", file=sys.stderr, flush=True)
    _end_children(signal.SIGTERM)
    sys.stdout.flush()
    exit_now(128 + (_stopped_by[0] if _stopped_by else signal.SIGINT))


def _stop_after_done(signum: int) -> None:
    """A stop signal after the run finished (its result complete: `done:` is printed or being printed): exit 0,
    since the run did all it was asked, saying what of the tidying up was left undone. While the summary is
    printed (milliseconds) the stop waits for it (main calls this again)."""
    if _finished[-1] == SUMMARY:
        _stopped_by.append(signum)
        return
    name = signal.Signals(signum).name
    _say(f"\nrlflow: {name} after the run had finished (done: above; its store, MLflow run and summary are "
         f"complete); left undone: {_finished[-1]}; exit code 0\n")
    _end_children(signal.SIGTERM)
    exit_now(0)


def _tidy_up() -> None:
    """After `done:`: the flow's last logs and events sent to Prefect's API here, not in the exit's atexit
    handlers, so that a stop meanwhile can say what it left undone."""
    _finished.append(LAST_LOGS)
    if _stopped_by:
        _stop_after_done(_stopped_by[0])
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=10)
    EventsWorker.drain_all(timeout=10)
    _finished.append(EXITING)


def whole_number(text: str) -> int:
    """argparse's type for a count: ASCII digits, an optional sign (int() also reads '٣' and '1_0')."""
    if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise argparse.ArgumentTypeError(f"expected a whole number in digits 0-9, got {text!r}")
    return int(text)


def cmd_tune(args) -> int:
    from flows.tune_space import check_arguments, check_metric, load_space, not_set_by, out_folder
    from tasks.core.config import load_config
    from tasks.core.stage import given_overrides

    check_arguments(args)
    check_path("--space", args.space, "file", writes=False)
    if args.out is not None:
        check_path("--out", args.out, "folder")
        if (Path(args.out) / "trials").is_file():
            raise UserError(f"--out: {Path(args.out) / 'trials'} is a file, not the folder of the trials' logs")
    cfg = load_config(args.config, given_overrides(args))   # one line and exit 2, before any trial starts
    check_metric(args.metric, cfg)
    if not args.out:
        check_path("--out (default rlflow-tune/<study>)", out_folder(args, cfg), "folder")
    space = load_space(args.space, args.config, args.override)
    from flows.tune import run_name, tune_flow
    from flows.tune_space import check_study

    check_study(args, cfg, space)   # a study resumed with another space: refused before a trial (and a warning) runs
    # What `rlflow run` of the base config refuses, before any trial, under a run name no trial has (the base run's
    # v0 or resume state is not a trial's); what it leaves here for trials to inherit (DS_ACCELERATOR, a worker) goes.
    from flows.tune_space import override_of, values_of
    from tasks.core.process_wide import environment_variables
    from tasks.scoring.functions import close_workers

    checked = [*not_set_by(args.override, ["run.name"]), f"run.name={run_name(cfg.run.name, {'preflight': True})}"]
    with environment_variables({"DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR")}):
        checked_config(argparse.Namespace(config=args.config, overrides_json="[]", override=checked))
        for key, param in space.items():        # each bound and choice as `rlflow run` would take it (a data
            for value in values_of(param):      # path that is not there, a warm start's length too short)
                try:
                    checked_config(argparse.Namespace(config=args.config, overrides_json="[]",
                                                      override=[*not_set_by(checked, [key]), override_of(key, value)]))
                except UserError as e:
                    raise UserError(f"--space: {key}: {value!r}: {e}") from None
    close_workers()

    server = None
    if not os.environ.get("PREFECT_API_URL"):      # one temporary API for the tune and all its trials' flow runs
        _shield_prefect_server()
        from prefect.server.api.server import SubprocessASGIServer

        print("starting Prefect's temporary API server for the tune and its trials (no PREFECT_API_URL set)",
              file=sys.stderr, flush=True)
        server = SubprocessASGIServer()
        server.start()
        set_variable("PREFECT_API_URL", server.api_url)
    try:
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: os.environ["PREFECT_API_URL"]}):
            out = tune_flow(args, cfg, space)
            from prefect.logging.handlers import APILogWorker

            APILogWorker.drain_all(timeout=10)        # (the flow's logs, before the temporary server goes)
    finally:
        if server is not None:
            server.stop()
    if out["stopped"]:
        print("tune interrupted; run the same command to resume (finished trials are kept)", file=sys.stderr)
        return 128 + out["stopped"]
    if out["unlogged"]:
        raise UserError(out["unlogged"])
    best = out["best"]
    if best is None:
        print("no trial completed: nothing to recommend (see the trials' logs)", file=sys.stderr)
        return 1
    print(f"\nbest: trial {best['trial']} ({best['run']}), {args.metric} {best['value']:.4f}: "
          + "  ".join(f"{k}={v}" for k, v in best["params"].items()))
    print(f"  config: {best['config']}   (rlflow run {best['config']})")
    return 0


def _shield_prefect_server() -> None:
    """Prefect's temporary API server (no PREFECT_API_URL) is this process's child; Ctrl-C reaches the whole
    foreground process group, and a server killed by it leaves the flow hanging on its API while it stops. So it
    is started in a session of its own, and told to die with this process (PR_SET_PDEATHSIG): a kill of the
    run still takes it along."""
    from prefect.server.api import server

    from tasks.scoring.worker import die_with_parent  # (standard library only)

    run = server.SubprocessASGIServer._run_uvicorn_command
    if getattr(run, "_rlflow", False):
        return

    def shielded(self):
        popen = subprocess.Popen

        def own_session(*args, **kwargs):
            return popen(*args, start_new_session=True, preexec_fn=die_with_parent, **kwargs)

        server.subprocess.Popen = own_session
        try:
            proc = run(self)
        finally:
            server.subprocess.Popen = popen
        if threading.current_thread().name != KEEPER:     # (one started again: by the keeper, which goes on)
            threading.Thread(target=_keep_serving, args=(self, proc), daemon=True, name=KEEPER).start()
        return proc

    stop = server.SubprocessASGIServer.stop

    def stopping(self):
        self._rlflow_stopping = True
        return stop(self)

    shielded._rlflow = True
    server.SubprocessASGIServer._run_uvicorn_command = shielded
    server.SubprocessASGIServer.stop = stopping


KEEPER = "rlflow-prefect-server"


def _keep_serving(server, proc) -> None:
    """Prefect's temporary API server started again on its port, with its database, where it ended during the run
    (a kill by pid, the OOM killer): the flow's client retried every call against the dead port, iterations took
    11-39 s instead of 0.2 and each wrote a multi-KB error line. Not once stopped (its stop, the run's end). This
    thread starts it and lives on: the server dies with the thread that started it (PR_SET_PDEATHSIG)."""
    import time

    import httpx

    from tasks.core.stage import STOP

    while True:
        while (code := proc.poll()) is None:    # (not wait(): Prefect's start() polls it for uvicorn's exit 3, a
            time.sleep(0.5)                     # port taken as it starts, which it handles itself)
        if getattr(server, "_rlflow_stopping", False) or server.server_process is not proc or _finished or \
                STOP.is_set() or code == 3:
            return
        print(f"rlflow: Prefect's temporary API server ended ({how_it_ended(code)}); starting it again on "
              f"{server.address}", file=sys.stderr, flush=True)
        # Its process only, `running` left True: a start() of Prefect's threads meanwhile stays a no-op (a second
        # server, or one on another port than the clients' URL, otherwise), the port the one they know.
        proc = server.server_process = server._run_uvicorn_command()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.api_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            print(f"rlflow: Prefect's temporary API server could not start again on {server.address} "
                  f"({how_it_ended(proc.poll()) if proc.poll() is not None else 'no answer in 120 s'}); stopping",
                  file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if any(t.is_alive() for t in USER_THREADS):      # (Python's own exit would wait for them: a failed run hung)
        exit_wound_down(code, "the run", end_children)
    return code


def _main(argv: list[str] | None) -> int:
    from tasks.core.stage import OneLineParser

    ap = OneLineParser(prog="rlflow", description="RL post-training as a scheduled, resumable pipeline.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) a training run from a config")
    run.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    run.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted config override, e.g. -o train.lr=1e-6 (repeatable)")
    run.add_argument("--overrides-json", default="[]", metavar="JSON",
                     help="overrides as a JSON list (what recipes and deployments pass)")
    run.add_argument("--summary-json", metavar="PATH", help="write a JSON summary of the run here")
    tune = sub.add_parser("tune", help="search config values with Optuna: each trial a run, pruned by its "
                                      "per-iteration metric, the study resumable, the best config as YAML")
    tune.add_argument("config", help="the base config; each trial is a run of it with the space's values")
    tune.add_argument("--space", required=True, metavar="SPACE.yaml",
                      help="config key -> {type: log_uniform|uniform|int|categorical, low/high or choices}")
    tune.add_argument("--trials", type=whole_number, required=True, metavar="N", help="trials in the study, in all")
    tune.add_argument("--parallel", type=whole_number, default=1, metavar="K", help="trials at once (default 1)")
    tune.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                      help="dotted config override for every trial (repeatable)")
    tune.add_argument("--metric", default="reward/mean", help="what a trial is judged by: a metric of each "
                      "iteration's reward, train or eval manifest (default reward/mean)")
    tune.add_argument("--direction", choices=["maximize", "minimize"], default="maximize")
    tune.add_argument("--window", type=whole_number, default=3, help="a trial's value: the mean of its last WINDOW "
                      "iterations' metric (also what is reported for pruning; default 3)")
    tune.add_argument("--pruner", choices=["median", "none"], default="median")
    tune.add_argument("--sampler", choices=["tpe", "random"], default="tpe")
    tune.add_argument("--seed", type=whole_number, default=0, help="the sampler's seed")
    tune.add_argument("--study", help="the study's name (default <run.name>-tune)")
    tune.add_argument("--storage", help="Optuna storage URL (default sqlite:///<out>/study.db)")
    tune.add_argument("--out", help="where the study, trial logs and best.yaml go (default rlflow-tune/<study>)")
    exp = sub.add_parser("export", help="write a published policy as a plain folder (from_pretrained loads it) "
                         "or as one GGUF file (llama.cpp, Ollama)")
    exp.add_argument("config", help="the run's config (its store, run.name and tracking.uri)")
    exp.add_argument("version", help="N, latest, best, or an MLflow model version: models:/NAME/3, "
                     "models:/NAME@champion")
    exp.add_argument("dest", help="a new (or empty) folder; or a new .gguf file")
    exp.add_argument("--format", choices=["folder", "gguf"], help="default: gguf when DEST ends in .gguf")
    exp.add_argument("--quant", choices=["f32", "f16", "q8_0"], help="GGUF tensor type of the matrices "
                     "(default f16; norms stay f32)")
    exp.add_argument("--register", action="store_true", help="GGUF: log the file as an artifact of the policy's "
                     "MLflow model version (tags rlflow.gguf, rlflow.gguf_quant)")
    exp.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted config override, e.g. -o run.name=other (repeatable)")
    exp.add_argument("--overrides-json", default="[]", metavar="JSON")
    pl = sub.add_parser("plan", help="check the config as `rlflow run` does (the same preflight: what run refuses, "
                        "plan refuses), then print every role's machines (stages, generate replicas, trainer nodes, "
                        "env servers), their counts, spot or not, SkyPilot's catalog price per hour and the total, "
                        "the store and the tracking URI; launches nothing and writes nothing to the store")
    pl.add_argument("config", help="YAML config")
    pl.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="dotted config override (repeatable)")
    pl.add_argument("--overrides-json", default="[]", metavar="JSON")
    from flows.warmup import add_commands

    add_commands(sub, "dotted config override (repeatable)", whole_number)
    args = ap.parse_args(argv)
    if args.command == "run":
        _stop_on_signals()
    try:
        code = {"run": cmd_run, "export": cmd_export, "plan": cmd_plan, "tune": cmd_tune, "sft": cmd_sft,
                "record": cmd_record}[args.command](args)
        if _finished:
            _tidy_up()
            exit_wound_down(code, "the run", end_children)
        elif _stopped_by:
            _interrupted()
        return code
    except BaseException as e:  # noqa: BLE001 - the exit code contract is decided here
        if _stopped_by and not _finished:   # what the interrupt turned into on its way up (Prefect's crash handling)
            _interrupted()
        end_children()               # (what a failed stage left running would keep the exit waiting for good)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        from flows.repair import final_line

        said = final_line(e, _run_cfg[-1].launcher.retries if _run_cfg else None)
        if said is not None:         # one line, not a traceback: what is committed stays, the command resumes
            print(said[0], file=sys.stderr)
            return said[1]
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())

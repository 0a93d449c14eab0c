"""`rlflow` — the command line.

    rlflow run CONFIG [-o key=value]... [--summary-json PATH]
    rlflow export CONFIG VERSION DIR [-o key=value]...    # a published policy as a folder from_pretrained loads

Exit codes: 0 success; 2 a user error (one line on stderr naming the field or row); 1 an internal error.
Prefect runs without a server (ephemeral) unless PREFECT_API_URL is set; then the run shows in that UI.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

from tasks.core.errors import UserError, cause_of


def _quiet_prefect() -> None:
    """Our progress lines are the console output; Prefect's logs still reach its API/UI unless verbose."""
    if not os.environ.get("RLFLOW_VERBOSE"):
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "CRITICAL")
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "CRITICAL")
    import logging

    logging.getLogger("mlflow").setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def cmd_run(args) -> int:
    from tasks.core.config import load_config
    from tasks.core.stage import parse_overrides_json

    overrides = parse_overrides_json(args.overrides_json) + args.override
    load_config(args.config, overrides)       # a bad config is one line and exit 2, before Prefect starts
    _quiet_prefect()
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from flows.training import train_flow

    summary = train_flow(args.config, overrides)
    public = {k: summary[k] for k in ("run", "iterations_completed", "reward_mean", "policy_uri", "mlflow_run_id")}
    if args.summary_json:
        Path(args.summary_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.summary_json).write_text(json.dumps(public, indent=2))
    print(f"\ndone: {summary['iterations_completed']} iterations, mean reward "
          f"{summary['reward_mean'][0]:.3f} -> {summary['reward_mean'][-1]:.3f}")
    print(f"  MLflow run:       {summary['mlflow']}")
    print(f"  published policy: {summary['policy_uri']}" +
          (f" (model version {summary['model_version']})" if summary.get("model_version") else ""))
    if summary.get("best_policy"):
        print(f"  best (eval):      {summary['best_policy']}")
    if summary.get("cost_usd"):
        print(f"  cost:             {summary['cost_usd']:.4f} USD")
    print(f"  reward curve:     {summary['reward_curve']}")
    return 0


def cmd_export(args) -> int:
    """VERSION: N, latest, best, or an MLflow model version (models:/NAME/3, models:/NAME@champion)."""
    from tasks.core import layout
    from tasks.core.config import load_config
    from tasks.core.policy import export
    from tasks.core.stage import parse_overrides_json
    from tasks.core.store import open_store

    cfg = load_config(args.config, parse_overrides_json(args.overrides_json) + args.override)
    store, run, version = open_store(cfg), cfg.run.name, args.version
    if version.isdigit():
        key = layout.policy(run, int(version))
    elif version in ("latest", "best"):
        key = store.get_pointer(layout.latest(run, "policy") if version == "latest" else layout.best(run))
        if key is None:
            raise UserError(f"VERSION: run {run!r} has no {version} policy in {store.uri(run)}")
    elif version.startswith("models:/"):
        key = _mlflow_policy(cfg, store, version)
    else:
        raise UserError(f"VERSION: expected a number, latest, best or models:/NAME/VERSION, got {version!r}")
    if store.manifest(key) is None:
        raise UserError(f"VERSION: no published policy at {store.uri(key)}")
    dest = Path(args.dir)
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise UserError(f"DIR: {dest} exists and is not an empty folder")
    print(export(store, key, dest))
    return 0


def _mlflow_policy(cfg, store, uri: str) -> str:
    """The store key of the policy an MLflow model version (models:/NAME/VERSION or models:/NAME@ALIAS) names."""
    from mlflow.exceptions import MlflowException

    from tasks.core.tracking import _client

    name, _, rest = uri[len("models:/"):].partition("/")
    if "@" in name:
        name, alias = name.split("@", 1)
    client = _client(cfg.tracking.uri)
    try:
        mv = client.get_model_version_by_alias(name, alias) if "@" in uri else client.get_model_version(name, rest)
    except MlflowException as e:
        raise UserError(f"VERSION: {uri}: {str(e).splitlines()[0][:200]}") from None
    source = mv.tags.get("rlflow.policy_uri") or mv.source
    root = store.root.rstrip("/") + "/"
    if not source.startswith(root):
        raise UserError(f"VERSION: {uri} names {source}, which is not in store.uri ({store.root})")
    return source[len(root):]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rlflow", description="RL post-training as a scheduled, resumable pipeline.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) a training run from a config")
    run.add_argument("config", help="YAML config, e.g. configs/tiny.yaml")
    run.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted config override, e.g. -o train.lr=1e-6 (repeatable)")
    run.add_argument("--overrides-json", default="[]", metavar="JSON",
                     help="overrides as a JSON list (what recipes and deployments pass)")
    run.add_argument("--summary-json", metavar="PATH", help="write a JSON summary of the run here")
    exp = sub.add_parser("export", help="write a published policy as a plain folder (from_pretrained loads it)")
    exp.add_argument("config", help="the run's config (its store, run.name and tracking.uri)")
    exp.add_argument("version", help="N, latest, best, or an MLflow model version: models:/NAME/3, "
                     "models:/NAME@champion")
    exp.add_argument("dir", help="a new (or empty) folder")
    exp.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                     help="dotted config override, e.g. -o run.name=other (repeatable)")
    exp.add_argument("--overrides-json", default="[]", metavar="JSON")
    args = ap.parse_args(argv)
    try:
        return cmd_run(args) if args.command == "run" else cmd_export(args)
    except BaseException as e:  # noqa: BLE001 - the exit code contract is decided here
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        user = cause_of(e, UserError)
        if user is not None:
            print(f"error: {user}", file=sys.stderr)
            return 2
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""`rlflow` — the command line.

    rlflow run CONFIG [-o key=value]... [--summary-json PATH]

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
    args = ap.parse_args(argv)
    try:
        return cmd_run(args)
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

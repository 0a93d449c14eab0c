"""The warm start in the flow and on the command line: SFT on demonstrations before RL (tasks/sft.py), and the
demonstrations recorded by a policy run through the environment (tasks/envs/runtime/demonstrations.py).

    rlflow record CONFIG --policy MODULE:FUNCTION|model --out FILE [--split train] [--rows 0-9] [--n 1]
    rlflow sft CONFIG [-o key=value]...      # the warm start alone: v0 in the store, metrics in MLflow
    rlflow run CONFIG                        # with `warmup:`, the warm start first (once), then iterations from v0

In the flow (`warm_start`): a Prefect task `sft` under the run's lease; its result, `<run>/policy/v000000`, becomes
model.name_or_path for every stage (generate's base policy, the train stage's start and KL reference, eval's
baseline), the way a champion does (`start_from: champion`, which skips the warm start: a champion was warm
started already). Its per-step metrics go to the run's MLflow run once (sft/loss, sft/token_accuracy, ...).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

from tasks.core.config import Config
from tasks.core.errors import UserError
from tasks.core.store import open_store


def overrides_after(result: dict) -> list[str]:
    """What the stages are given once v0 exists: it as their model, the warmup section done."""
    return [f"model.name_or_path={result['uri']}", "warmup=null"]


def warm_start(cfg: Config, log) -> list[str]:
    """The warm start under the flow's lease (reused when v0 exists from the same inputs), its metrics logged;
    returns the overrides that make v0 every stage's starting policy."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    from tasks.core import layout
    from tasks.sft import sft

    store = open_store(cfg)
    fresh = store.manifest(layout.policy(cfg.run.name, 0)) is None
    result = task(sft, name="sft", task_run_name="sft[warm start]", cache_policy=NO_CACHE)(cfg)
    log_metrics(cfg)
    if fresh:
        log.info("warm start: v0 %s (sft loss %.4f after %d steps)", result["uri"], result["metrics"]["sft/loss"],
                 result["metrics"]["sft/steps"])
    return overrides_after(result)


LOG_BATCH = 1000            # metrics an MLflow call (its log_batch limit)


def log_metrics(cfg: Config, end: bool = False) -> None:
    """v0's per-step history (its manifest keeps it) into the run's MLflow run, at the steps, once; `end`: the run
    is then marked finished (`rlflow sft` alone; the flow's iterations go on in the same MLflow run)."""
    from mlflow.entities import Metric

    from tasks.core import layout
    from tasks.core.tracking import Tracker

    store = open_store(cfg)
    history = (store.manifest(layout.policy(cfg.run.name, 0)) or {}).get("meta", {}).get("history", [])
    tracker = Tracker(cfg, store.root)
    run_id = tracker.start(store)
    if tracker.superseded:
        print(tracker.superseded, flush=True)
    # each key's steps not logged yet: a kill between two batches had left the rest unlogged for good (the first
    # batch's sft/loss read as "logged")
    keys = sorted({k for h in history for k in h if k != "step"})
    logged = {k: {m.step for m in tracker.client.get_metric_history(run_id, f"sft/{k}")} for k in keys}
    batch = [Metric(f"sft/{k}", float(v), 0, h["step"]) for h in history for k, v in h.items()
             if k != "step" and h["step"] not in logged[k]]
    for i in range(0, len(batch), LOG_BATCH):
        tracker.client.log_batch(run_id, metrics=batch[i:i + LOG_BATCH])
    if end:
        tracker.end()


# ------------------------------------------------------------------------------------------ the commands

def add_commands(sub, override_help: str, whole_number) -> None:
    sft = sub.add_parser("sft", help="the warm start alone: SFT on warmup.path's demonstrations, published as the "
                         "run's starting policy v0 (rlflow run does it first when the config has warmup:)")
    sft.add_argument("config", help="YAML config with a warmup section")
    sft.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE", help=override_help)
    sft.add_argument("--overrides-json", default="[]", metavar="JSON")
    rec = sub.add_parser("record", help="record demonstrations: a policy run through the config's environment, "
                         "its successful episodes written as TRL `messages` rows (warmup.path reads them)")
    rec.add_argument("config", help="YAML config with an environment (env.factory)")
    rec.add_argument("--policy", required=True, help="MODULE:FUNCTION (context text -> the next turn's text, e.g. "
                     "tasks.envs.builtin.webshop:reference_action) or `model` (the config's model, greedy)")
    rec.add_argument("--out", required=True, help="a .jsonl file to write (replaced whole)")
    rec.add_argument("--split", choices=["train", "eval"], default="train")
    rec.add_argument("--rows", help="row indices of the split: 0-9,12 (default: every row)")
    rec.add_argument("--n", type=whole_number, default=1, help="episodes per row (default 1)")
    rec.add_argument("--min-return", type=float, default=1.0, help="keep episodes whose return is at least this "
                     "(default 1.0: solved)")
    rec.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE", help=override_help)
    rec.add_argument("--overrides-json", default="[]", metavar="JSON")


def sft_command(cfg: Config) -> int:
    """`rlflow sft`, given the config checked by the preflight (flows/cli.py: checked_config)."""
    from tasks.core.lease import Lease
    from tasks.sft import sft

    if cfg.warmup is None:
        raise UserError("warmup: the config has no warmup section (warmup.path: the demonstrations)")
    store = open_store(cfg)
    lease = Lease(store, cfg.run.name, cfg.run.lease_seconds).acquire()
    try:
        if removed := store.clean_staging(cfg.run.name):        # (the lease holder: what a killed one left)
            print(f"removed {removed} half-written staging folder(s) or file(s) left by an interrupted run")
        result = sft(cfg)
    finally:
        lease.release()
    log_metrics(cfg, end=True)
    m = result["metrics"]
    print(f"v0: {result['uri']}  (sft: {m['sft/steps']:g} steps, loss {m['sft/loss']:.4f}, token accuracy "
          f"{m['sft/token_accuracy']:.3f})")
    return 0


MAX_ROWS = 1_000_000        # rows `rlflow record` takes in one call (checked before a range is written out)


def _rows(text: str | None) -> list[int] | None:
    if text is None:
        return None
    rows: list[int] = []
    try:
        for part in text.split(","):
            a, dash, b = part.strip().partition("-")
            if not a.isdigit() or not a.isascii() or dash and not (b.isdigit() and b.isascii()):
                raise ValueError        # ("3-": a range without its end; int() reads '٣' as 3, '1_0' as 10)
            if b and int(b) < int(a):
                raise UserError(f"--rows: {part.strip()}: an empty range (its end before its start); expected "
                                f"FIRST-LAST with FIRST <= LAST")
            if b and int(b) - int(a) >= MAX_ROWS or len(rows) >= MAX_ROWS:
                raise UserError(f"--rows: {text}: more than {MAX_ROWS:,} rows; record at most that many at a time")
            rows += list(range(int(a), int(b) + 1)) if b else [int(a)]
    except ValueError:
        raise UserError(f"--rows: expected indices like 0-9,12, got {text!r}") from None
    return rows


def record_command(args, cfg: Config) -> int:
    """`rlflow record` (flows/cli.py has checked --out and loaded the config)."""
    from tasks.envs.runtime.demonstrations import RecordingProgress, job_of, record, write

    out = Path(args.out).expanduser()
    if out.suffix not in (".jsonl", ".json"):
        raise UserError(f"--out: {out}: rlflow record writes JSON Lines (TRL's `messages` rows, what warmup.path "
                        f"reads); expected a file name ending .jsonl")
    for field, path in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path)):
        if path and out.exists() and Path(path).exists() and os.path.samefile(path, out):
            raise UserError(f"--out: {out} is the config's {field} (the prompts it records from), which it would "
                            f"replace; expected another file")
    if args.n < 1:
        raise UserError(f"--n: expected at least 1 episode per row, got {args.n}")
    if not math.isfinite(args.min_return):
        raise UserError(f"--min-return: {args.min_return}: expected a finite return")
    rows = _rows(args.rows)
    with RecordingProgress(out, job_of(cfg, args.policy, rows, args.n, args.split, args.min_return)) as progress:
        if progress.done:
            print(f"{out}: going on from an interrupted recording: {progress.done} rows "
                  f"({progress.episodes} episodes) recorded before", file=sys.stderr)
        record(cfg, args.policy, rows, args.n, args.min_return, args.split, skip=progress.done,
               on_chunk=progress.add)
        if not progress.kept:
            episodes = progress.episodes
            progress.discard()
            failed = f" (the first error: {' '.join(progress.failed.split())[:300]})" if progress.failed else ""
            raise UserError(f"--policy: none of its {episodes} episodes returned {args.min_return:g} or more "
                            f"without an error; nothing to write{failed}")
        write(progress.kept, out)
    print(f"{out}: {len(progress.kept)} demonstrations of {progress.episodes} episodes (return >= "
          f"{args.min_return:g})" + (f"; {progress.unrendered} left out: they do not render back to their own "
                                     f"tokens" if progress.unrendered else ""), file=sys.stderr)
    return 0

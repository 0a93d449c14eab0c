"""What every stage shares: its input check, the input fingerprint, reuse of a complete output, its result,
and its command line.

A stage is `stage(cfg, iteration, ...) -> {"key", "uri", "metrics"}`, pure over the store: when its output
folder is complete and was made from the same inputs (same fingerprint), it returns that folder without
recomputing. An output made from *different* inputs under the same run name is a user error: silently
mixing two configs in one run would corrupt it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from tasks.core.errors import UserError, corrupt_line, user_error_line

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store


def require_input(store: Store, key: str, iteration: int, what: str, stage: str) -> dict:
    """The manifest of a stage's input folder; a missing one is the user's mistake (stages run out of order)."""
    manifest = store.manifest(key)
    if manifest is None:
        raise UserError(f"iteration {iteration}: no complete {what} at {store.uri(key)}; run {stage} first")
    return manifest


def fingerprint(cfg: Config, sections: tuple[str, ...], **inputs) -> str:
    blob = json.dumps({"config": cfg.section_hash(*sections), "seed": cfg.run.seed, **inputs}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def reuse(store: Store, key: str, fp: str) -> dict | None:
    manifest = store.manifest(key)
    if manifest is None:
        return None
    if manifest.get("meta", {}).get("fingerprint") != fp:
        raise UserError(f"run: {store.uri(key)} was made from a different config or input; "
                        f"resume with the same config or choose a new run.name")
    return result(store, key, manifest)


def result(store: Store, key: str, manifest: dict) -> dict:
    return {"key": key, "uri": store.uri(key), "metrics": manifest.get("meta", {}).get("metrics", {})}


def parse_overrides_json(text: str) -> list[str]:
    try:
        items = json.loads(text or "[]")
    except ValueError:
        raise UserError(f"--overrides-json: expected a JSON list of 'key=value' strings, got {text!r}") from None
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise UserError(f"--overrides-json: expected a JSON list of 'key=value' strings, got {text!r}")
    return items


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a missing or malformed flag is one line on stderr naming it (`error: ...`), exit 2: the
    user-error contract, not argparse's usage block."""

    def error(self, message: str):
        print(f"error: {self.prog}: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


_OWN_PROCESS = False
STOP = threading.Event()    # set when the run was told to stop (SIGINT/SIGTERM, flows/cli.py): no stage starts after


def in_stage_process() -> bool:
    """Whether this process was started for one stage run (`python -m tasks.<stage>`), so ends with it."""
    return _OWN_PROCESS


def quiet_progress_bars() -> None:
    """No download/loading/writing progress bars in a stage process's log (or a trainer's): they are a screen
    of carriage returns there. transformers reads the setting when imported, so it is told directly too."""
    import os

    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bars()
        disable_progress_bar()
    except ImportError:
        pass


def stage_cli(fn: Callable[..., dict], name: str, takes_policy: bool = False, takes_tracking: bool = False) -> None:
    """`python -m tasks.<stage> --config F [-o k=v]... --iteration N [--policy KEY]`; prints the result JSON."""
    from tasks.core.config import load_config

    ap = OneLineParser(prog=f"python -m tasks.{name}", description=fn.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--overrides-json", default="[]", metavar="JSON",
                    help='overrides as a JSON list (what recipes pass), e.g. \'["train.lr=1e-6"]\'')
    ap.add_argument("--iteration", type=int, required=True)
    if takes_policy:
        ap.add_argument("--policy", default=None, help="'base' or the store key of a published policy: the one "
                        "the schedule names (checked); default: that one")
    if takes_tracking:
        ap.add_argument("--mlflow-run-id", default=None)
    args = ap.parse_args()
    # (evaluate's iteration 0: the base model, eval.baseline; `train finish` ignores it: sky/train.yaml passes 0)
    first = 0 if name in ("evaluate", "train finish") else 1
    if args.iteration < first:
        ap.error(f"argument --iteration: iterations start at {first}, got {args.iteration}")
    global _OWN_PROCESS
    _OWN_PROCESS = True
    quiet_progress_bars()
    try:
        cfg = load_config(args.config, parse_overrides_json(args.overrides_json) + args.override)
        kwargs = {}
        if takes_policy:
            kwargs["policy"] = args.policy
        if takes_tracking:
            kwargs["mlflow_run_id"] = args.mlflow_run_id
        out = fn(cfg, args.iteration, **kwargs)
    except UserError as e:
        # The second line lets a launcher tell a user error from a crash when only the log comes back.
        print(user_error_line(e), file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        from tasks.core.store import CorruptArtifact

        if not isinstance(e, CorruptArtifact):
            raise
        print(corrupt_line(e.key, str(e)), file=sys.stderr)      # the flow quarantines and recomputes it
        sys.exit(3)
    print(json.dumps(out))

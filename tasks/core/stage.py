"""What every stage shares: its input check, the input fingerprint, reuse of a complete output, its result,
and its command line.

A stage is `stage(cfg, iteration, ...) -> {"key", "uri", "metrics"}`, pure over the store: when its output
folder is complete and was made from the same inputs (same fingerprint), it returns that folder without
recomputing. An output made from *different* inputs under the same run name is a user error: silently
mixing two configs in one run would corrupt it.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
import threading
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.artifacts import CorruptArtifact
from tasks.core.errors import DiskFull, UserError, corrupt_line, disk_full, disk_full_line, user_error_line
from tasks.core.hashing import digest
from tasks.core.process_wide import ExitRefused, exit_wound_down, set_variable
from tasks.core.processes import end_children

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.processes import Streamed
    from tasks.core.store import Store


# The steps of an iteration in the order they run (by hand: one after another), what each leaves in the store,
# and what each reads: a stage given an iteration whose inputs are not there names the first step to run.
STEPS = ("generate", "reward", "train", "publish", "evaluate")
OUTPUT = {"generate": ("rollouts", layout.rollouts), "reward": ("scored rollouts", layout.rewards),
          "train": ("checkpoint", layout.checkpoint), "publish": ("published policy", layout.policy),
          "evaluate": ("evaluation", layout.evaluation)}


def inputs_of(stage: str, iteration: int, max_staleness: int) -> list[tuple[str, int]]:
    """The (stage, iteration) steps whose outputs `stage` of `iteration` reads."""
    if stage == "generate":
        version = layout.version_of(layout.behaviour_policy("r", iteration, max_staleness))
        return [("publish", version)] if version else []
    if stage == "train":
        return [("reward", iteration)] + ([("train", iteration - 1)] if iteration > 1 else [])
    before = {"reward": "generate", "publish": "train", "evaluate": "publish"}[stage]
    return [(before, iteration)] if iteration else []


def first_missing(store: Store, run: str, stage: str, iteration: int, max_staleness: int) -> tuple[str, int] | None:
    """The earliest step (by iteration, then stage order) whose output `stage` of `iteration` needs, directly or
    through other missing outputs, and which is not complete in the store: what to run first. None: all there."""
    missing, seen, todo = set(), set(), [(stage, iteration)]
    while todo:
        for step in inputs_of(*todo.pop(), max_staleness):
            if step not in seen:
                seen.add(step)
                if store.manifest(OUTPUT[step[0]][1](run, step[1])) is None:
                    missing.add(step)
                    todo.append(step)
    return min(missing, key=lambda s: (s[1], STEPS.index(s[0]))) if missing else None


def require_input(store: Store, cfg: Config, stage: str, iteration: int, step: tuple[str, int]) -> dict:
    """The manifest of the output of `step` (stage, iteration), an input of `stage` of `iteration`; a missing or
    incomplete one is the user's mistake (stages run out of order): one line naming it and the command to run
    first."""
    key = OUTPUT[step[0]][1](cfg.run.name, step[1])
    manifest = store.manifest(key)
    if manifest is None:
        first = first_missing(store, cfg.run.name, stage, iteration, cfg.run.max_staleness) or step
        then = "" if first == step else f", then each stage in order ({', '.join(STEPS[:4])}) through " \
                                        f"{step[0]} --iteration {step[1]}"
        rounds = " (generate.dynamic_sampling: generate, then reward, with --round 0, 1, ... until the reward " \
                 "stage says the iteration's batch is complete)" if cfg.generate.dynamic_sampling is not None and \
            "reward" in (step[0], first[0]) else ""
        raise UserError(f"{stage} of iteration {iteration}: no complete {OUTPUT[step[0]][0]} of iteration "
                        f"{step[1]} at {store.uri(key)}; run first: {command(first[0], first[1])}{then}{rounds}")
    return manifest


def check_round(cfg: Config, round: int) -> None:
    """A round (generate and reward) is dynamic sampling's (generate.dynamic_sampling), below its max_rounds: one
    line if not."""
    ds = cfg.generate.dynamic_sampling
    if round and ds is None:
        raise UserError(f"--round {round}: rounds are dynamic sampling's; set generate.dynamic_sampling")
    if ds is not None and not 0 <= round < ds.max_rounds:
        raise UserError(f"--round {round}: expected 0 to {ds.max_rounds - 1} "
                        f"(generate.dynamic_sampling.max_rounds {ds.max_rounds})")


def fingerprint(cfg: Config, sections: tuple[str, ...], **inputs) -> tuple[str, dict]:
    """The fingerprint of a stage's output, and what it is made of (the fingerprinted values of `sections`, the
    seed, `inputs`): kept in the output's manifest as `made_of`, so a refused resume can name what changed."""
    made = {**made_of(cfg, sections), **inputs}
    if files := data_files(cfg, sections):
        made["files"] = files
    return fingerprint_of(made), made


def data_files(cfg: Config, sections: tuple[str, ...]) -> dict[str, str]:
    """The sha256 of each local file the fingerprinted sections read as data ({"data.path": ..., "eval.path":
    ...}): a file whose path stayed and whose bytes changed (a held-out file overwritten between sessions) makes
    other outputs, as a changed setting does. A hub id, or a path that is not a file here: nothing. (The warm
    start's warmup.path is v0's input: tasks/sft.py fingerprints its bytes.)"""
    named = {"data": (("data.path", cfg.data.path),),
             "eval": (("eval.path", cfg.eval.path),)}
    out = {}
    for section in sections:
        for field, path in named.get(section, ()):
            if path and (sha := file_sha256(str(path))) is not None:
                out[field] = sha
    return out


def file_sha256(path: str) -> str | None:
    """A local file's sha256, read once per process and file version (tasks/core/hashing.py remembers a large
    one's across processes too); None: not a file here."""
    from pathlib import Path

    try:
        st = Path(path).expanduser().stat()
    except OSError:
        return None
    return _sha256_of(str(Path(path).expanduser()), st.st_size, st.st_mtime_ns, st.st_ino) \
        if Path(path).expanduser().is_file() else None


@functools.lru_cache(maxsize=16)
def _sha256_of(path: str, size: int, mtime_ns: int, inode: int) -> str:
    from pathlib import Path

    from tasks.core.hashing import known_sha256

    return known_sha256(Path(path))


def fingerprint_of(made: dict) -> str:
    """The fingerprint of what `made` says (fingerprint's `made`, or a manifest's `made_of`: the section values
    are what Config.section_hash hashes)."""
    inputs = {k: v for k, v in made.items() if k not in ("config", "seed")}
    return digest({"config": digest(made["config"]), "seed": made["seed"], **inputs})


def made_of(cfg: Config, sections: tuple[str, ...]) -> dict:
    """The config part of what an output is made from (its fingerprinted sections' values and the seed); a
    checkpoint's trainer writes it too (tasks/engines/trainer.py), without the inputs only the stage knows."""
    return {"config": cfg.section_values(*sections), "seed": cfg.run.seed}


def reuse(store: Store, key: str, fp: str, made: dict | None = None) -> dict | None:
    """The result of `key` when it is complete and made from the same inputs (fingerprint `fp`); None when it is
    not there; a UserError when it was made from others, naming the fields that changed (from the manifest's
    `made_of`, against `made`) and how to go on; a CorruptArtifact when its manifest contradicts itself."""
    manifest = store.manifest(key)
    if manifest is None:
        return None
    if (found := manifest.get("meta", {}).get("fingerprint")) != fp:
        was = manifest.get("meta", {}).get("made_of")
        if made_before_files(manifest, made):
            return result(store, key, manifest)    # (made before outputs named their files' bytes: as it is)
        if made is not None and isinstance(was, dict) and was.keys() == made.keys() and fingerprint_of(was) != found:
            raise CorruptArtifact(key, f"{store.uri(key)}: its manifest's fingerprint is not that of what it says "
                                       f"it was made of (the manifest was edited)")
        raise UserError(f"run: {store.uri(key)} was made from a different config or input"
                        + (changed(was, made) if was is not None and made is not None else
                           "; resume with the same config or choose a new run.name"))
    return result(store, key, manifest)


def changed(was: dict, now: dict, shown: int = 3) -> str:
    """What differs between an output's `made_of` and this run's, as the end of a refusal: the config fields with
    old -> new values (the first `shown`; "and N more"), or the inputs, and how to go on."""
    now = json.loads(json.dumps(now))                 # (as the manifest holds it: tuples are lists there)
    old, new = _dotted(was.get("config", {})), _dotted(now.get("config", {}))
    if was.get("seed") != now.get("seed"):
        old["run.seed"], new["run.seed"] = was.get("seed"), now.get("seed")
    fields = sorted(k for k in old.keys() | new.keys() if old.get(k, _UNSET) != new.get(k, _UNSET))
    files = {k: v for k, v in (was.get("files") or {}).items() if k in (now.get("files") or {}) and
             now["files"][k] != v}
    if files and not fields:
        named = ", ".join(f"{k} {_dotted(now.get('config', {})).get(k, '')}".rstrip() for k in sorted(files))
        one = len(files) == 1
        return (f": {named} changed since this run's outputs were made from {'it (its' if one else 'them (their'} "
                f"bytes differ); restore the file{'' if one else 's'} they were made from, or choose a new run.name")
    if not fields:
        inputs = sorted(k for k in was.keys() - {"config", "seed"} if was[k] != now.get(k))
        if inputs == ["policy"]:         # (a rollout's: sampled from policy S+1 iterations back, S run.max_staleness)
            return (f": the same config, another policy sampled ({was['policy']} -> {now.get('policy')}), as a "
                    f"changed run.max_staleness makes it; resume with the run.max_staleness it was made with, or "
                    f"choose a new run.name")
        what = f" ({', '.join(inputs)})" if inputs else ""
        return (f": the same config, other inputs{what}: an earlier output of this run was made again; "
                f"choose a new run.name")

    def show(v) -> str:
        return "(unset)" if v is _UNSET else v if isinstance(v, str) else json.dumps(v)

    listed = ", ".join(f"{k} {show(old.get(k, _UNSET))} -> {show(new.get(k, _UNSET))}" for k in fields[:shown])
    more = f" and {len(fields) - shown} more" if len(fields) > shown else ""
    back = " ".join(f"-o {k}={show(old[k])}" for k in fields[:shown] if k in old)
    return (f": {listed}{more}; resume with the values it was made with"
            f"{f' ({back}{more})' if back else ''}, or choose a new run.name")


_UNSET = object()


def _dotted(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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


def given_overrides(args) -> list[str]:
    """A command's overrides as the user gave them: --overrides-json, then each -o (of a key given twice, the
    last is used, as commands built from a base list and a change expect)."""
    return parse_overrides_json(getattr(args, "overrides_json", "[]")) + list(args.override)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a missing or malformed flag is one line on stderr naming it (`error: ...`), exit 2: the
    user-error contract, not argparse's usage block."""

    def error(self, message: str):
        print(f"error: {self.prog}: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


_OWN_PROCESS = False
STOP = threading.Event()    # set when the run was told to stop (SIGINT/SIGTERM, flows/cli.py): no stage starts after


def launched() -> bool:
    """Whether a launcher started this stage process, rather than a user by hand: the local and sky launchers run
    the stage's recipe on a SkyPilot node or as one would (flows/launch.py: Local sets SKYPILOT_NODE_RANK); a
    torchrun worker (RANK) was started by a stage process, which reads its output."""
    return "SKYPILOT_NODE_RANK" in os.environ or "RANK" in os.environ


def by_hand() -> bool:
    """A stage command typed by a user (`python -m tasks.<stage>`, no launcher): no flow will tidy up after it."""
    return _OWN_PROCESS and not launched()


_CONFIG_ARGS = ["--config", "CONFIG"]     # this stage command's --config and overrides (stage_cli), for command()


def command(stage: str, iteration: int) -> str:
    """The command line that runs `stage` ("train finish" too) for `iteration` with this stage command's config
    and overrides: what a message tells the user to run."""
    module, *sub = stage.split()
    return shlex.join(["python", "-m", f"tasks.{module}", *sub, *_CONFIG_ARGS, "--iteration", str(iteration)])


def quiet_progress_bars() -> None:
    """No download/loading/writing progress bars in a stage process's log (or a trainer's): they are a screen
    of carriage returns there. transformers reads the setting when imported, so it is told directly too."""
    set_variable("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils.logging import disable_progress_bar

        disable_progress_bars()
        disable_progress_bar()
    except ImportError:
        pass


def stage_cli(fn: Callable[..., dict], name: str, takes_policy: bool = False, takes_tracking: bool = False,
              takes_round: bool = False, takes_services: bool = False,
              own_process: Callable[[Config], Config] | None = None) -> None:
    """`python -m tasks.<stage> --config F [-o k=v]... --iteration N [--policy KEY] [--round R]`; prints the
    result JSON. `takes_services`: the stage's context is read here, once, from the variables the flow gave this
    process (tasks/core/placement.py: Services.from_environment). `own_process`: what the stage makes of its
    config in a process of its own (the train stage: where its trainer lives), applied once, here."""
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
    if takes_round:
        ap.add_argument("--round", type=int, default=0, help="generate.dynamic_sampling: the iteration's round "
                        "(0, the first, unless the previous round's reward said it was not complete)")
    args = ap.parse_args()
    # (evaluate's iteration 0: the base model, eval.baseline; `train finish` ignores it: sky/train.yaml passes 0)
    first = 0 if name in ("evaluate", "train finish", "sft") else 1
    if args.iteration < first:
        ap.error(f"argument --iteration: iterations start at {first}, got {args.iteration}")
    global _OWN_PROCESS
    _OWN_PROCESS = True
    quiet_progress_bars()
    try:
        overrides = parse_overrides_json(args.overrides_json) + args.override
        _CONFIG_ARGS[:] = ["--config", args.config, *(a for o in overrides for a in ("-o", o))]
        cfg = load_config(args.config, overrides)
        if own_process is not None:
            cfg = own_process(cfg)
        kwargs = {}
        if takes_policy:
            kwargs["policy"] = args.policy
        if takes_tracking:
            kwargs["mlflow_run_id"] = args.mlflow_run_id
        if takes_round and args.round:
            kwargs["round"] = args.round
        if takes_services:
            from tasks.core.placement import Services

            kwargs["services"] = Services.from_environment()
        out = fn(cfg, args.iteration, **kwargs)
    except UserError as e:
        # The second line lets a launcher tell a user error from a crash when only the log comes back; typed by
        # hand, the command says it in one line.
        print(f"error: {e}" if by_hand() else user_error_line(e), file=sys.stderr)
        _end(2)
    except ExitRefused as e:                 # (a user's os._exit in this process, let through: a failure)
        print(f"error: {e}", file=sys.stderr)
        _end(1)
    except SystemExit as e:                  # (a user's code; as Python ends: a code, or a message and 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        _end(e.code if isinstance(e.code, int) else 1 if e.code is not None else 0)
    except Exception as e:
        full = disk_full(e)
        if full is not None:                                      # not retried: the run stops, resumable
            print(f"error: {full}" if by_hand() else disk_full_line(full), file=sys.stderr)
            _end(full.exit_code)
        if not isinstance(e, CorruptArtifact):
            traceback.print_exc()
            _end(1)
        print(corrupt_line(e.key, str(e)), file=sys.stderr)      # the flow quarantines and recomputes it
        _end(3)
    except BaseException as e:  # noqa: BLE001 - a Ctrl-C, a deadline: said as Python would, then the same end
        traceback.print_exc()
        _end(130 if isinstance(e, KeyboardInterrupt) else 1)
    print(json.dumps(out))
    _end(0)


def _end(code: int) -> None:
    """A stage process's end, however it ends (process_wide.exit_wound_down): rlflow's own threads finish (a
    trainer's full checkpoint being written takes as long as it takes); users' do not hold it."""
    exit_wound_down(code, "the stage", end_children, seconds=None)


def scored_fingerprint(cfg: Config) -> str:
    """What a streamed group's scores are made from (the reward settings, tasks/scoring/streamed.py): a group
    scored under others (a config edited before a resume) is scored again, by the scorer or the reward stage."""
    return fingerprint(cfg, ("reward", *cfg.env_sections()))[0]


def made_before_files(manifest: dict | None, made: dict | None) -> bool:
    """Whether an output was made, before outputs named their data files' bytes (data_files), from what `made`
    says but those: taken as it is."""
    meta = (manifest or {}).get("meta", {})
    return made is not None and "files" in made and isinstance(meta.get("made_of"), dict) and \
        "files" not in meta["made_of"] and fingerprint_of({k: v for k, v in made.items() if k != "files"}) == \
        meta.get("fingerprint")


def fingerprinted_as(manifest: dict | None, fp: str) -> bool:
    """Whether an output is there and carries fingerprint `fp` (one written before such outputs carried one:
    taken as it is)."""
    return manifest is not None and manifest.get("meta", {}).get("fingerprint", fp) == fp


def scored_here(cfg: Config, manifest: dict | None) -> bool:
    """Whether a streamed group's scores (its stream_scored folder's manifest) are this config's."""
    return fingerprinted_as(manifest, scored_fingerprint(cfg))


def raise_failure(ran: Streamed, what: str) -> None:
    """What ended a process (a group: torchrun) that exited with a code other than 0, raised here as its own: its
    user error as one line, a corrupt artifact, a full disk, else `what` failed, with its last lines (torchrun
    exits 1 whatever its processes' codes were: their marker lines say)."""
    if ran.user_error:
        raise UserError(ran.user_error)
    if ran.corrupt:
        from tasks.core.store import CorruptArtifact

        raise CorruptArtifact(*ran.corrupt)
    if ran.disk_full:
        raise DiskFull(ran.disk_full)
    raise RuntimeError(f"{what} exited with {ran.code}: "
                       + " | ".join(line.strip() for line in ran.last[-20:] if line.strip())[-1500:])

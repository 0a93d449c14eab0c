"""Where a stage runs: `inline` (this process: the flow calls the stage function, no launcher), `local` (a
subprocess running the stage recipe's `run`, as SkyPilot would run it), `sky` (a SkyPilot cluster or managed
job). Same contract for both launchers:

    launcher.run(stage, iteration, env) -> Ran(seconds, hourly_usd)

raises `UserError` when the stage rejected its input (exit code 2: never retried), `CorruptArtifact` when it
found a committed artifact corrupt (exit code 3: the flow recomputes it), `DiskFull` when a disk it writes
filled (exit code 4: not retried, the run stops resumable), and `InfraError` for
anything the infrastructure did (killed process, preempted or vanished cluster, non-zero exit): the flow
retries those with back-off. A remote stage's result is read back from the store by the flow (the stage
function finds its own output's manifest and returns it without recomputing). The servers a run starts beside
its stages, and Launchers (each stage's launcher, for the flow), are in flows/services.py.

More: docs/internals.md (flows/launch.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from tasks.core.errors import DiskFull, UserError
from tasks.core.paths import REPO_ROOT, sibling_python
from tasks.core.processes import stream
from tasks.core.store import CorruptArtifact

if TYPE_CHECKING:
    from tasks.core.config import Config

BRIDGE = Path(__file__).with_name("sky_bridge.py")
# Stages that share a machine kind share a cluster: evaluate generates; publish follows train. env, replica and
# judge: the clusters of the servers that flows/services.py starts.
CLUSTER_OF = {"generate": "gen", "evaluate": "gen", "reward": "reward", "train": "train", "publish": "train",
              "env": "env",      # (env.where: sky: the environment server's CPU cluster; EnvServer)
              "replica": "replica",   # (generate.replicas on sky: <cluster>-<i>, one per replica; Launchers)
              "judge": "judge"}       # (reward.models where: sky: <cluster>-<name>, one per model; JudgeServers)
MAX_CLUSTER_NAME = 60          # (SkyPilot's own rule is [a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?; clouds want less)
_PLAIN = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")     # kept as it is in a cluster's name


def cluster_name(prefix: str, run: str, role: str, member: str | None = None) -> str:
    """The one SkyPilot cluster of (run name, role) (CLUSTER_OF's values; `member`: one of several, a replica's or
    environment server's index, `front`, a judge's name): <prefix>-<run>-<role>[-<member>] where that is a name
    already (lowercase letters, digits, single hyphens, at most MAX_CLUSTER_NAME) that reads back one way only;
    else the run name lowercased and cut, and `--` and 8 hex of the exact (run, role, member):
    `Run_A` -> rlflow-run-a-gen--e3718cb5, never run-a's rlflow-run-a-gen (a plain name has no `--`)."""
    tail = role + (f"-{member}" if member is not None else "")
    name = f"{prefix}-{run}-{tail}"
    if (_PLAIN.fullmatch(run) and _PLAIN.fullmatch(tail) and len(name) <= MAX_CLUSTER_NAME
            and not (role == "judge" and _reads_as_role(tail.split("-")[1:]))):
        return name
    digest = hashlib.sha256(f"{run}\0{tail}".encode()).hexdigest()[:8]
    tail = _slug(tail)[:12].strip("-")
    room = MAX_CLUSTER_NAME - len(prefix) - len(tail) - len(digest) - 4     # (its hyphens: 1, 1 and 2)
    return f"{prefix}-{_slug(run)[:room].strip('-')}-{tail}--{digest}"


def _slug(text: str) -> str:
    return "-".join(part for part in re.split(r"[^a-z0-9]+", text.lower()) if part)


def _reads_as_role(parts: list[str]) -> bool:
    """Some end of a judge's name (its parts from one on) is a role's own tail: run `a`'s judge `gen` would be
    run `a-judge`'s gen cluster."""
    def role(p: list[str]) -> bool:
        return (p in (["gen"], ["reward"], ["train"], ["env"]) or (p[0] == "judge" and len(p) > 1)
                or (len(p) == 2 and p[0] in ("env", "replica") and (p[1].isdigit() or p == ["env", "front"])))
    return any(role(parts[k:]) for k in range(len(parts)))


class InfraError(RuntimeError):
    """A failure of the machinery, not of the user's input: worth retrying."""


@dataclass
class Ran:
    seconds: float
    hourly_usd: float | None = None     # price of the machine it ran on, when known


def recipes_folder(cfg: Config) -> Path:
    """launcher.recipes as a folder. A relative one is the folder of that name in the working directory (a project
    of your own, run from its root) if there is one, else in the checkout rlflow runs from (REPO_ROOT: its sky/):
    `rlflow plan` and the `local` launcher find the recipes from any directory."""
    folder = Path(cfg.launcher.recipes).expanduser()
    return folder if folder.is_absolute() or folder.is_dir() else REPO_ROOT / folder


def recipe_path(cfg: Config, stage: str) -> Path:
    """<launcher.recipes>/<stage>.yaml (recipes_folder), parsed (check_recipe)."""
    path = recipes_folder(cfg) / f"{stage}.yaml"
    if not path.is_file():
        folder = Path(cfg.launcher.recipes).expanduser()
        looked = folder if folder.is_absolute() else f"{folder.absolute()} or {REPO_ROOT / folder}"
        raise UserError(f"launcher.recipes: no recipe {path} for stage {stage!r} (recipes folder: {looked})")
    check_recipe(path)
    return path


def check_recipe(path: Path) -> dict:
    """The recipe YAML parsed; one UserError line naming the file and line where it does not parse, or is not a
    mapping (what SkyPilot and the local launcher read)."""
    try:
        recipe = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(f"launcher.recipes: {path}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"launcher.recipes: {path}:{where}: not valid YAML ({problem})") from None
    if recipe is not None and not isinstance(recipe, dict):
        raise UserError(f"launcher.recipes: {path}: expected a mapping (a SkyPilot task), got "
                        f"{type(recipe).__name__}")
    return recipe or {}


def stage_env(cfg_path: str, overrides: list[str], iteration: int, policy: str | None = None,
              round: int = 0) -> dict[str, str]:
    env = {"CONFIG": str(cfg_path), "OVERRIDES": json.dumps(list(overrides)), "ITERATION": str(iteration)}
    if round:                                    # (dynamic sampling: the generate and reward recipes' ROUND)
        env["ROUND"] = str(round)
    if policy is not None:
        env["POLICY"] = policy
    return env


class Local:
    """Run the recipe's `run` in a subprocess with the recipe's envs, the flow's values for them, and the
    recipe's secrets from this environment: what a SkyPilot node would execute, on this machine. `setup`
    is not run (this machine is already set up). A stage process that has beaten (the file BEAT_VAR names,
    touched every 5 s from its Python's start: tasks/__init__.py) and then stops for HUNG_SECONDS is stopped by a
    signal or wedged: it is killed, and the stage retried. Before its first beat only a stage whose every process is
    stopped (SIGSTOP, SIGTSTP) is timed (a recipe may install for long before its Python starts)."""

    mode = "local"
    BEAT_VAR = "RLFLOW_HEARTBEAT"
    HUNG_SECONDS = 120.0
    WATCH_SECONDS = 5.0

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def run(self, stage: str, iteration: int, env: dict[str, str], log) -> Ran:
        recipe = yaml.safe_load(recipe_path(self.cfg, stage).read_text())
        envs = {k: str(v) for k, v in (recipe.get("envs") or {}).items() if v is not None}
        envs.update(env)
        secrets = {k: os.environ[k] for k in (recipe.get("secrets") or {}) if k in os.environ}
        full = {**os.environ, **envs, **secrets, "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "127.0.0.1",
                "SKYPILOT_NUM_NODES": "1", "PYTHONUNBUFFERED": "1",
                # the recipe says `python`: make it this environment's Python
                "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        t0 = time.perf_counter()
        hung: list[float] = []
        with tempfile.NamedTemporaryFile(prefix="rlflow-beat-") as beat:
            full[self.BEAT_VAR] = beat.name
            made = os.stat(beat.name).st_mtime_ns           # (before the stage starts: its first beat differs)
            # (the recipe runs `python -m tasks.<stage>`: spawn's safe path, the working directory's tasks/ never
            # wins)
            ran = stream(["bash", "-c", recipe["run"]], full, log, cwd=Path.cwd(), rlflow=True,
                         watch=lambda proc: self._watch(proc, beat.name, made, hung))
        seconds = time.perf_counter() - t0
        if hung:
            raise InfraError(f"{stage}[iter {iteration}]: the local stage process gave no heartbeat for "
                             f"{hung[0]:.0f} s (stopped by a signal, or wedged): killed; a retry runs it again")
        if ran.code == 0:
            return Ran(seconds)
        if ran.code == 2 and ran.user_error:
            raise UserError(ran.user_error)
        if ran.code == 3 and ran.corrupt:
            raise CorruptArtifact(*ran.corrupt)
        if ran.code == DiskFull.exit_code and ran.disk_full:
            raise DiskFull(ran.disk_full)
        killed = " (killed)" if ran.code < 0 or ran.code in (137, 143) else ""
        raise InfraError(f"{stage}[iter {iteration}]: local stage process exited with {ran.code}{killed}: "
                         + "\n".join(ran.last[-3:]).strip())

    def _watch(self, proc, beat: str, last: int, hung: list[float]) -> None:
        """Until `proc` ends: one whose stage process has beaten once and then not touched `beat` for HUNG_SECONDS
        is killed, with what it started (stopped processes too: SIGKILL ends them still). The time is this
        watcher's checks without a beat, not the clock: a flow paused (Ctrl-Z, a laptop asleep) kills nothing on
        waking; and before the first beat only checks that found every process of the stage stopped count (a
        user's recipe may install for long before its Python starts; one stopped there hung the run for good)."""
        from tasks.core.processes import descendants

        beaten, quiet, stopped = False, 0, 0             # (`last`: the file's time as made)
        while proc.poll() is None:
            time.sleep(self.WATCH_SECONDS)
            try:
                now = os.stat(beat).st_mtime_ns
            except OSError:
                return
            beaten, quiet, last = beaten or now != last, 0 if now != last else quiet + 1, now
            stopped = stopped + 1 if _all_stopped([proc.pid, *descendants(proc.pid)]) else 0
            silent = max(quiet if beaten else 0, stopped) * self.WATCH_SECONDS
            if silent > self.HUNG_SECONDS and proc.poll() is None:
                hung.append(silent)
                for pid in [*descendants(proc.pid), proc.pid]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                return

    def close(self, log) -> None:
        pass


def _all_stopped(pids: list[int]) -> bool:
    """Whether every one of `pids` is stopped by a signal (state T in /proc; not t, a debugger's stop; False where
    that cannot be read: gone, or no /proc)."""
    try:
        return all(Path(f"/proc/{pid}/stat").read_text().rpartition(") ")[2][:1] == "T" for pid in pids)
    except OSError:
        return False


class Sky:
    """Clusters launched once per flow run (idle autostop), each stage sent with `sky exec`; a vanished or
    preempted cluster is launched again on the retry; managed-job mode hands recovery to SkyPilot. The SDK
    runs in SkyPilot's own environment through flows/sky_bridge.py."""

    mode = "sky"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.launched: set[str] = set()
        self._launching: dict[str, threading.Lock] = {}     # stages of two iterations may ask for one cluster
        self.python = cfg.launcher.sky_python or sibling_python(".venv-sky") or "python3"

    def cluster(self, stage: str, member: str | None = None) -> str:
        """The cluster of a stage or served role (cluster_name: unique per run name and role)."""
        return cluster_name(self.cfg.launcher.cluster_prefix, self.cfg.run.name, CLUSTER_OF[stage], member)

    def _bridge(self, args: list[str], log) -> dict:
        ran = stream([self.python, str(BRIDGE), *args], dict(os.environ), log, cwd=Path.cwd())
        for line in reversed(ran.last):
            line = line.strip()
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    break
        raise InfraError(f"SkyPilot bridge ({shlex.join(args[:3])}) failed with exit code {ran.code}: "
                         + "\n".join(ran.last[-3:]).strip())

    def run(self, stage: str, iteration: int, env: dict[str, str], log) -> Ran:
        lc = self.cfg.launcher
        recipe = str(recipe_path(self.cfg, stage))
        envs = [f"--env={k}={v}" for k, v in env.items()]
        # launcher.accelerators: the stage's GPU type, else (one cluster, one machine) its cluster-mate's
        gpus = lc.accelerators.get(stage) or (None if lc.managed_jobs else next(
            (a for s, a in lc.accelerators.items() if CLUSTER_OF[s] == CLUSTER_OF[stage]), None))
        gpu = ["--accelerators", gpus] if gpus else []
        t0 = time.perf_counter()
        if lc.managed_jobs:
            out = self._bridge(["job", "--name", f"{self.cluster(stage)}-{stage}-{iteration}", "--recipe", recipe,
                                *envs, *gpu], log)
        else:
            cluster = self.cluster(stage)
            # The first stage on a cluster launches it, the others wait for that (stages of several iterations
            # run at once with run.max_staleness > 0); once it is up they only `sky exec`.
            args = ["run", "--cluster", cluster, "--recipe", recipe, "--idle-minutes",
                    str(lc.idle_minutes_to_autostop), *envs, *gpu]
            with self._launching.setdefault(cluster, threading.Lock()):
                launch = cluster not in self.launched
                if launch:
                    out = self._bridge([*args, "--launch"], log)
                    self.launched.add(cluster)
            if not launch:
                out = self._bridge(args, log)
            if out.get("cluster_missing"):
                self.launched.discard(cluster)        # the retry launches it again
                raise InfraError(f"{stage}[iter {iteration}]: cluster {cluster} is gone (preempted or torn "
                                 f"down): {out.get('error') or 'job did not finish'}")
        seconds = time.perf_counter() - t0
        if out.get("user_error"):
            raise UserError(out["user_error"])
        if out.get("corrupt"):
            raise CorruptArtifact(*out["corrupt"])
        if out.get("disk_full"):
            raise DiskFull(out["disk_full"])
        if out.get("exit_code") != 0:
            raise InfraError(f"{stage}[iter {iteration}]: SkyPilot job failed (exit code {out.get('exit_code')})")
        return Ran(seconds, out.get("hourly_usd"))

    def serve(self, what: str, port: int, wait: int, env: dict, log, member: str | None = None) -> str:
        """A long-lived server job (sky/<what>.yaml) on its own cluster, answering on `port`: its URL, once
        it answers. The cluster is launched the first time, and again when it is gone (preempted); it is torn
        down with the others by close(). `member`: one of several such servers, on cluster <cluster>-<member>
        (env.servers > 1: the environment pool's members and its front). Asked again (the server stopped
        answering), the cluster's jobs are cancelled first (--fresh): a server that hung holds the port."""
        cluster = self.cluster(what, member)
        args = ["serve", "--cluster", cluster, "--recipe", str(recipe_path(self.cfg, what)), "--port", str(port),
                "--fresh", "--wait", str(wait), "--idle-minutes", str(self.cfg.launcher.idle_minutes_to_autostop),
                *[f"--env={k}={v}" for k, v in env.items()],      # launcher.accelerators of the served role:
                *(["--accelerators", gpus] if (gpus := self.cfg.launcher.accelerators.get(
                    {"replica": "generate"}.get(what, what))) else [])]
        with self._launching.setdefault(cluster, threading.Lock()):
            out = self._bridge(args + (["--launch"] if cluster not in self.launched else []), log)
            if out.get("cluster_missing") and cluster in self.launched:
                self.launched.discard(cluster)            # preempted: launched again, once, here
                out = self._bridge([*args, "--launch"], log)
            if out.get("url"):
                self.launched.add(cluster)
        if out.get("user_error"):
            raise UserError(out["user_error"])
        if not out.get("url"):
            raise InfraError(f"the {what} server on {cluster} did not start: "
                             f"{out.get('error') or 'exit code ' + str(out.get('exit_code'))}")
        log(f"{what} server: {out['url']} on {cluster}")
        return out["url"]

    def close(self, log) -> None:
        if not self.cfg.launcher.down:
            return
        for cluster in sorted(self.launched):
            try:
                self._bridge(["down", "--cluster", cluster], log)
            except InfraError as e:
                log(f"teardown of {cluster} failed: {e}")
        self.launched.clear()

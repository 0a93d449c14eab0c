"""The daemons rlflow starts and finds again: one per run and kind on a machine, alive across stage processes, each
named by a state file. Three servers are started and found again through `Daemon`: the vLLM server
(tasks/engines/vllm_server.py, its watchdog tasks/engines/vllm_watchdog.py), the resident trainer
(tasks/engines/detached.py) and the generate replicas' router (tasks/engines/replica_router.py). Four more use only the
daemon's side (`Watch`, `leave`): the environment server (tasks/envs/runtime/server.py), the environment pool's front
(tasks/envs/runtime/pool.py), a generate replica (tasks/engines/replica.py) and the judge server
(tasks/scoring/judge_server.py), each kept by what started it (the flow, the router: tasks/core/fleet.py) and
never found again.

The caller's side (`Daemon`): the state file, `ensure`, `start`, `stop`. The daemon's side: `Watch`, `forget`,
`leave`.

Standard library and tasks.core.processes only: the vLLM server's watchdog imports this under the vLLM
environment's interpreter, where it should not cost a torch import (tests/test_layout.py).
More: docs/internals.md (tasks/core/daemon.py): each side, in full.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tasks.core.processes import alive, exclusive, spawn_detached, terminate_members

T = TypeVar("T")


def read_state(path: Path) -> dict | None:
    """The state file at `path` (None: missing or unreadable, e.g. a file a killed writer never finished)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_state(path: Path, state: dict) -> None:
    """Write the state file atomically (a reader sees the old file or the new one) and readable by its owner
    only: it may hold a key that lets whoever reads it command the daemon."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)          # (a .tmp left by a killed writer may have had another mode)
        f.write(json.dumps(state))
    os.replace(tmp, path)


def named(path: Path) -> int | None:
    """The pid the state file names (None: no state file)."""
    state = read_state(path)
    return state.get("pid") if state is not None else None


def carries(pid: int | None, marker: str) -> bool:
    """Whether process `pid` exists and its command line contains `marker` (compared lower-case): the daemon a
    state file names, not another program that got its pid after it ended. (Without /proc, e.g. macOS, a
    command line cannot be read: a live pid is taken at its word.)"""
    if not pid:
        return False
    if not Path("/proc").is_dir():
        return alive(pid)
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker.lower() in cmdline.lower()


def tail(log: Path, lines: int = 25) -> str:
    """The last `lines` lines of a log ("" if there is none yet)."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) if log.exists() else ""


def answers_http(url: str, timeout: float = 5.0) -> bool:
    """An HTTP daemon's readiness probe: GET `url` (its health route) answers 200."""
    import http.client
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (OSError, ValueError, http.client.HTTPException):
        return False


class DidNotStart(RuntimeError):
    """A daemon or a fleet's member (tasks/core/fleet.py) exited before it was ready, or was not ready in time (the
    message ends with its last lines)."""


# ------------------------------------------------------------------------------------------ the caller's side

class Daemon:
    """One daemon of one kind by its state file `path`: `marker` is what every one of its processes' command
    lines carries (what `stop` may signal); `stop_wait` how long it gets to exit on SIGTERM before SIGKILL."""

    def __init__(self, path: Path, marker: str, stop_wait: float = 10.0):
        self.path, self.marker, self.stop_wait = path, marker.lower(), stop_wait
        self.log = path.with_suffix(".log")
        self.lock = path.with_suffix(".lock")

    def read(self) -> dict | None:
        return read_state(self.path)

    def write(self, state: dict) -> None:
        write_state(self.path, state)

    def ensure(self, key: str, answers: Callable[[dict], bool], start: Callable[[], T]) -> dict | T:
        """The state of the daemon the state file names if it serves `key` and `answers` (its readiness probe,
        given its state) says so; else that one is stopped and `start()` starts a new one (its result
        returned). One caller at a time per daemon on this machine: two that ask together start one, not two.
        A daemon found again is marked used now (the state file's mtime): a watchdog that measures idle time
        by it must not stop it under its new user."""
        with exclusive(self.lock):
            state = self.read()
            if state is not None:
                pid = state.get("pid")
                if state.get("key") == key and carries(pid, self.marker) and alive(pid) and answers(state):
                    os.utime(self.path)
                    return state
                self.stop(state)                  # dead, hung, or made for another version or config
            return start()

    def start(self, argv: list[str], env: dict[str, str], ready: Callable[[dict], T | None], timeout: float,
              what: str, state: dict | None = None, watch: list[str] | None = None, poll: float = 0.1) -> T:
        """Start the daemon detached (its output appended to the log; `watch`: a watchdog beside it, see
        spawn_detached) and return what `ready(state)` returns once it is not None. `state`: the caller writes
        the state file (these fields, plus pid, pgid, log, started) before the wait, so a caller killed
        meanwhile leaves it to be found and stopped; None: the daemon writes it itself (`ready` is then given
        only {pid, pgid}). If the daemon exits first or `timeout` s pass, it is stopped and DidNotStart raised,
        with the tail of its log."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        pid = spawn_detached(argv, {**env, "LOG": str(self.log)}, watch)
        try:
            pgid = os.getpgid(pid)
        except ProcessLookupError:            # (exited already: the wait below says so)
            pgid = None
        mine = {"pid": pid, "pgid": pgid}
        if state is not None:
            mine = {**mine, **state, "log": str(self.log), "started": time.time()}
            self.write(mine)
        deadline = time.monotonic() + timeout
        while (got := ready(mine)) is None:
            if not alive(pid) or time.monotonic() > deadline:
                why = "it exited" if not alive(pid) else f"no answer in {timeout:.0f} s"
                log = tail(self.log)
                self.stop(mine)
                raise DidNotStart(f"{what} did not come up ({why}; log {self.log}):\n{log}")
            time.sleep(poll)
        return got

    def stop(self, state: dict | None = None) -> None:
        """Stop the daemon `state` names (default: the state file's): SIGTERM, then SIGKILL after `stop_wait` s, to
        the processes of its group that carry the marker (its workers and watchdog too). The group is the one
        recorded at its start (its leader may be gone and its workers not), else that of its pid if that is
        still one of ours; nothing is signalled when neither is known. Then the state file is forgotten if it
        still names that process."""
        state = self.read() if state is None else state
        if state is None:
            return
        pid, pgid = state.get("pid"), state.get("pgid")
        if pgid is None and carries(pid, self.marker):
            try:
                pgid = os.getpgid(pid)
            except ProcessLookupError:
                pgid = None
        terminate_members(pgid, self.marker, self.stop_wait)
        forget(self.path, pid)


# ------------------------------------------------------------------------------------------ the daemon's side

def forget(path: Path | None, pid: int | None) -> None:
    """Remove the state file if it still names `pid` (a newer daemon's is not ours to remove)."""
    if path is not None and pid is not None and named(path) == pid:
        path.unlink(missing_ok=True)


def leave(path: Path | None = None, pid: int | None = None, code: int = 0) -> None:
    """The daemon exits now: forgotten first (no caller finds it on its way out), its output flushed."""
    forget(path, pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Watch:
    """Why a daemon should leave, asked every so often (`check`, or `wait` in a loop of its own):
      "replaced"  the state file `state` no longer names `pid` (the run forgot it or started another). Until
                  the file has named it once, a missing file counts only after `wait_named` s: for a daemon
                  whose caller writes the state file just after starting it (the vLLM server's watchdog);
      "idle"      `unused()` (seconds since it was last used; None: in use now) exceeds `idle` s (None, 0: never);
      "orphaned"  the process `parent` that started it is no longer its parent (the flow that holds it ended),
                  or the process `owner` (what started a detached daemon, which is no child of it) has exited.
    """

    def __init__(self, pid: int | None = None, state: Path | None = None, wait_named: float = 0.0,
                 idle: float | None = None, unused: Callable[[], float | None] = lambda: None,
                 parent: int | None = None, owner: int | None = None):
        self.pid, self.state, self.wait_named, self.idle = pid, state, wait_named, idle
        self.unused, self.parent, self.owner = unused, parent, owner
        self.started, self.named_once = time.monotonic(), False

    def check(self) -> str | None:
        if self.state is not None:
            now = named(self.state)
            self.named_once = self.named_once or now == self.pid
            if now != self.pid and (self.named_once or now is not None
                                    or time.monotonic() - self.started > self.wait_named):
                return "replaced"
        if self.idle and (unused := self.unused()) is not None and unused > self.idle:
            return "idle"
        if self.parent is not None and os.getppid() != self.parent or self.owner is not None and not alive(self.owner):
            return "orphaned"
        return None

    def wait(self, poll: float, while_alive: int | None = None) -> str:
        """Check every `poll` s until there is a reason to leave (returned), or process `while_alive` (a
        watchdog's daemon) has exited: "exited"."""
        while while_alive is None or alive(while_alive):
            time.sleep(poll)
            if (why := self.check()) is not None:
                return why
        return "exited"

"""What every fleet of servers rlflow runs shares, written once: the generate replicas behind their router
(tasks/engines/replica_router.py), the environment servers behind a pool's front (tasks/envs/runtime/pool.py,
flows/services.py: EnvServer) and the judge servers (flows/services.py: JudgeServers).

    start_server   a member on this machine: spawned with the safe path (processes.spawn), up once it prints
                   `<ready> <url>`, its output to its owner's log for its whole life, a user error raised as one
    bearer, authorized
                   the run's token: the header a client sends, the check a server makes (every route but /health)
    Health         a member is lost when refused, or after LOST_AFTER failed probes in a row; an answer resets it
    Starts         a member's starts that failed in a row: the next one waits (0, 5, 10 .. 60 s); START_TRIES: given up
    least_loaded   new work to the member with the least in flight, then the fewest routed, then the lowest index
    Sticky         an episode's later requests to the member that took its first (a bounded map, oldest out first)
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TypeVar

from tasks.core.daemon import DidNotStart
from tasks.core.errors import UserError, user_error_in
from tasks.core.processes import how_it_ended, kill_group, spawn

M = TypeVar("M")
LOST_AFTER = 2              # failed probes in a row (a timeout, a broken connection, an HTTP error) before "lost"
START_TRIES = 3             # starts in a row that failed before a member is given up (its owner says so at once)
BACKOFF, MAX_BACKOFF = 5.0, 60.0    # seconds more before each start after the second failure in a row, at most


def start_server(argv: list[str], env: Mapping[str, str], ready: str, name: str, short: str,
                 log: Callable[[str], object], timeout: float, python: str = sys.executable) -> tuple:
    """`python argv...` on this machine, a server that prints `<ready> <url>` once it answers: (its process, its
    URL, the last lines it printed). Its output goes to `log` after `short` for its whole life. One that does not
    answer within `timeout` is ended; its one-line user error, if it printed one, is raised as such."""
    import os

    proc = spawn([python, *argv], {**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    tail: list[str] = []
    found: list[str] = []
    answered = threading.Event()

    def drain() -> None:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail[:] = (tail + [line])[-20:]
            if line.startswith(ready) and not found:
                found.append(line.split()[1])
                answered.set()
                continue
            log(f"{short}: {line}")
        answered.set()
    threading.Thread(target=drain, daemon=True, name=f"{short}-log").start()
    if not answered.wait(timeout) or not found:
        code = proc.poll()
        kill_group(proc)
        said = next((u for u in map(user_error_in, tail) if u), None)
        if said:
            raise UserError(said)
        how = "still running" if code is None else how_it_ended(code)
        raise DidNotStart(f"the {name} did not start ({how}): " + "\n".join(tail[-3:]).strip())
    log(f"{name}: {found[0]} (pid {proc.pid})")
    return proc, found[0], tail


def bearer(token: str | None) -> dict[str, str]:
    """The header a client of a fleet member sends with the run's token (none without one)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(headers: Mapping[str, str], token: str | None) -> bool:
    """What a member checks of a request (not /health): the run's token, when it has one."""
    return not token or headers.get("authorization") == f"Bearer {token}"


class Health:
    """A member's probes: `failed()` after a probe that got no good answer says whether the member is now lost
    (LOST_AFTER in a row; `refused`: a refused connection, lost at once), `answered()` resets the count."""

    def __init__(self):
        self.failures = 0

    def answered(self) -> None:
        self.failures = 0

    def failed(self, refused: bool = False) -> bool:
        self.failures += 1
        return refused or self.failures >= LOST_AFTER


class Starts:
    """A member's starts that failed in a row: `failure(e)` after one, `started()` after one that answered. The
    next start is `due()` at once after the first failure, then BACKOFF s more per failure (at most MAX_BACKOFF):
    a member that cannot start is not started again every second. `given_up()` after START_TRIES failures: a
    fleet whose every member (on this machine) is given up says so, with the last `error`, instead of waiting."""

    def __init__(self):
        self.failed, self.retry_at, self.error = 0, 0.0, ""

    def started(self) -> None:
        self.failed, self.retry_at, self.error = 0, 0.0, ""

    def failure(self, error: object) -> None:
        self.failed += 1
        self.retry_at = time.monotonic() + min(BACKOFF * (self.failed - 1), MAX_BACKOFF)
        self.error = str(error)[-500:]

    def due(self) -> bool:
        return time.monotonic() >= self.retry_at

    def given_up(self) -> bool:
        return self.failed >= START_TRIES


def least_loaded(members: Iterable[M], load: Callable[[M], tuple]) -> M:
    """The member new work goes to: the smallest `load` (in flight, then routed, then index: a stable order)."""
    return min(members, key=load)


class Sticky(OrderedDict):
    """Keys (an episode's) to the member index that took their first request, the oldest dropped past `size`."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def remember(self, key: str, index: int) -> None:
        self[key] = index
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)

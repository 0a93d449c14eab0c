"""Preflight's check of the environment (protocol.check_environment) in a process of its own, where the episodes'
environments run in processes of their own (env.isolation: process): env.factory's module imported, one
environment made with env.kwargs, reset and stepped with the data's first row, there and never in rlflow's
process. What the user's code does to its process (a crash in a C extension, SIGKILL, os._exit, closing stdout,
chdir, a process or thread it leaves running, a loop that swallows the deadline) is one line naming env.factory,
exit 2, as the episodes' own processes would meet it, instead of a run that dies without a word.

    check_in_process(cfg, datasets)     # returns once the child said so, or raises UserError with its line

The child (`python -m tasks.envs.runtime.probe FD`) reads the request from its stdin and says, as JSON lines on
FD, which step it is at (its deadlines are the parent's) and then its answer; it is killed with its group after,
and a keeper (processes.fork_keeper) takes in what the user's code forked away, to be killed with it. What it
prints reaches this process's stderr within $RLFLOW_USER_OUTPUT_BYTES.
"""

from __future__ import annotations

import json
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from tasks.core.errors import UserError
from tasks.core.paths import import_hung, user_code_seconds
from tasks.core.process_wide import user_output_limit
from tasks.core.processes import BoundedCopy, how_it_ended, kill_group, peek_exit, spawn

if TYPE_CHECKING:
    from tasks.core.config import Config

START_SECONDS = 120.0        # the child's Python and rlflow's imports, before it names its first step
CHECK_SECONDS = 60.0         # beyond the user's own deadlines (the factory's RLFLOW_IMPORT_SECONDS, reset/step's)
ANSWER_CLOSED = 70           # the child's exit code when the user's code closed the descriptor it answers on


class Rows:
    """What check_environment reads of a split, taken here so that the child needs no dataset: its columns, its
    length, its `environment` column (TRL's multi-environment form) and the rows it makes environments with
    (the first, and the first of each environment named)."""

    def __init__(self, ds):
        from tasks.envs.runtime.protocol import ENVIRONMENT_COLUMN

        self.column_names, self.length = list(ds.column_names), len(ds)
        self.names = list(ds[ENVIRONMENT_COLUMN]) if ENVIRONMENT_COLUMN in self.column_names else None
        wanted = {0} if self.length else set()
        seen: set = set()
        for i, name in enumerate(self.names or ()):
            if isinstance(name, str) and name not in seen:
                seen.add(name)
                wanted.add(i)
        self.rows = {i: dict(ds[i]) for i in sorted(wanted)}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: int | str) -> Any:
        from tasks.envs.runtime.protocol import ENVIRONMENT_COLUMN

        if isinstance(key, str) and (key != ENVIRONMENT_COLUMN or self.names is None):
            raise KeyError(key)
        return self.names if isinstance(key, str) else self.rows[key]


def check_in_process(cfg: Config, datasets: list) -> None:
    """check_environment(cfg, first row, datasets) run by a child process; its UserError raised here as it is,
    and its death or silence as one line naming env.factory."""
    seconds = user_code_seconds()
    rows = [Rows(ds) for ds in datasets]
    made = max(1, len({n for r in rows for n in r.names or () if isinstance(n, str)}))   # (a dict: each made in turn)
    limits = {"start": START_SECONDS, "import": seconds + CHECK_SECONDS,
              "check": made * (seconds + 10.0) + CHECK_SECONDS}
    try:        # (where it runs first: sys.path and the folder, then what may need them to unpickle)
        request = pickle.dumps({"cwd": os.getcwd(), "path": list(sys.path)}) + \
            pickle.dumps({"config": cfg.model_dump(mode="json"), "datasets": rows})
    except Exception:  # noqa: BLE001 - a row that cannot travel: checked here, as before
        from tasks.envs.runtime.protocol import check_here

        check_here(cfg, datasets)
        return
    read, write = os.pipe()
    proc = copy = None
    step, answer = "start", None
    try:
        try:
            # (`-m` from the user's folder: spawn's safe path, so that it imports rlflow's tasks, not a tasks/ there)
            proc = spawn([sys.executable, "-m", "tasks.envs.runtime.probe", str(write)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, pass_fds=(write,),
                         start_new_session=True, cwd=os.getcwd())
        finally:
            os.close(write)
        out, proc.stdout = proc.stdout, None            # (the copier's to close: kill_group closes what Popen holds)
        copy = BoundedCopy(out, user_output_limit, "preflight's check of the environment")
        # (from a thread: a request larger than the pipe holds must not hold this one past the child's deadline)
        threading.Thread(target=_send, args=(proc.stdin, request), daemon=True, name="rlflow-probe-request").start()
        lines = _Lines(read, proc)
        while answer is None:
            said = lines.next(limits[step])
            if said is None:
                answer = ("silent", None)
            elif said[0] == "at":
                step = said[1]
            else:
                answer = said
    finally:
        if proc is not None:
            kill_group(proc)        # it, and what the user's code started in its group or in groups of their own
        os.close(read)
        if copy is not None:
            copy.wait(5.0)          # (what it wrote, before what is said of it)
    kind, value = answer
    if kind == "ok":
        return
    if kind == "user":
        raise UserError(value)
    spec, module = cfg.env.factory, str(cfg.env.factory).partition(":")[0]
    if step == "start":             # (before any of the user's code ran: rlflow's, or this machine's)
        why = how_it_ended(value) if kind == "ended" else f"no word in {START_SECONDS:g} s" if kind == "silent" \
            else value
        raise RuntimeError(f"preflight's check of env.factory ({spec}): its process did not start ({why})")
    doing = {"start": f"started (before it imported module {module!r})", "import": f"imported module {module!r}",
             "check": "made one with env.kwargs, then reset and stepped it with the data's first row"}[step]
    if kind == "ended" and value == ANSWER_CLOSED:
        raise UserError(f"env.factory: {spec}: the environment's code closed the descriptors of the process preflight "
                        f"checks it in (the one its answer goes out on among them) as it {doing}; expected it to "
                        f"close only what it opened")
    if kind == "ended":
        raise UserError(f"env.factory: {spec}: the environment's code ended the process preflight checks it in "
                        f"({how_it_ended(value)}) as it {doing}; expected it to leave its process running (a crash "
                        f"or an exit there would end each episode's; run it by hand to see why)")
    if kind == "silent":
        if step == "import":
            raise UserError(import_hung("env.factory", module, seconds, "callable"))     # (as import_user says it)
        raise UserError(f"env.factory: {spec}: preflight's check of the environment did not end in "
                        f"{limits[step]:g} s as it {doing} (it waits or loops past its deadlines there; "
                        f"RLFLOW_IMPORT_SECONDS allows more)")
    # (raised there: by the user's code, or by rlflow's after the user's code changed the process under it)
    raise UserError(f"env.factory: {spec}: preflight's check of the environment failed as it {doing}: {value}")


class _Lines:
    """The child's JSON lines, each within its time, read from the pipe's descriptor (never through a buffer
    select cannot see): a line, ("ended", its returncode) once it has ended with nothing more said (a process it
    forked may hold the pipe open: its end is watched, not the pipe's), or None when it says nothing in time."""

    def __init__(self, fd: int, proc: subprocess.Popen):
        self.fd, self.proc, self.buf = fd, proc, b""

    def next(self, timeout: float) -> tuple | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            readable = select.select([self.fd], [], [], min(max(deadline - time.monotonic(), 0), 0.5))[0]
            chunk = os.read(self.fd, 1 << 16) if readable else b""
            self.buf += chunk
            if chunk:
                continue
            if (code := self._ended()) is not False:
                while select.select([self.fd], [], [], 0)[0] and (chunk := os.read(self.fd, 1 << 16)):
                    self.buf += chunk           # (what it said before it ended comes first)
                if b"\n" not in self.buf:
                    return "ended", code
                break
            if time.monotonic() >= deadline:
                return None
            if readable:
                time.sleep(0.05)                # (the pipe at its end, the process not yet ended)
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            kind, value = json.loads(line)
        except (ValueError, TypeError):
            return "failed", f"an answer it did not write: {line[:200]!r}"
        return kind, value

    def _ended(self) -> int | None | bool:
        """Its returncode once it has ended (None: reaped elsewhere, not known), False while it runs."""
        try:
            code = peek_exit(self.proc)
        except ChildProcessError:
            return None
        return False if code is None else code


# ------------------------------------------------------------------------------------------------ the child

def _send(stdin, request: bytes) -> None:
    try:
        stdin.write(request)
        stdin.close()
    except OSError:
        pass                        # (it has ended: said as it ended)


def _main(fd: int) -> None:
    import fcntl

    from tasks.core.process_wide import free_directory
    from tasks.core.processes import fork_keeper

    fork_keeper()                      # (what the user's code forks away is the keeper's, killed with it)
    free_directory()
    try:                               # (above the descriptors a daemon-style closerange(3, 256) closes)
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 512)
        os.close(fd)
        fd = high
    except OSError:
        pass
    where = pickle.load(sys.stdin.buffer)
    os.chdir(where["cwd"])
    sys.path[:] = where["path"]
    request = pickle.load(sys.stdin.buffer)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)

    def say(kind: str, value: Any = None) -> None:
        try:
            os.write(fd, (json.dumps([kind, value]) + "\n").encode())
        except OSError:                # (the user's code closed it: said by the parent as this process's end)
            os._exit(ANSWER_CLOSED)

    try:
        from tasks.core.config import Config
        from tasks.core.config_base import _HELD
        from tasks.envs.runtime.protocol import check_here, factories_of

        _HELD.lines = []               # (its warnings were said as rlflow loaded it: not twice)
        cfg, datasets = Config.model_validate(request["config"]), request["datasets"]
        _HELD.lines = None
        say("at", "import")
        factories_of(cfg)              # env.factory cannot be imported: one line
        say("at", "check")
        check_here(cfg, datasets)      # (the factory's own preflight too, where it has one: the browser's)
        say("ok")
    except UserError as e:
        say("user", str(e))
    except BaseException as e:  # noqa: BLE001 - a SystemExit, a KeyboardInterrupt (its SIGINT), said to the parent
        say("failed", type(e).__name__ + "".join(f": {line[:500]}" for line in str(e).splitlines()[:1]))
    while True:                        # (the parent kills it with its group: nothing the user's code left runs on)
        time.sleep(3600)


if __name__ == "__main__":
    _main(int(sys.argv[1]))

"""Child processes: `spawn`, the one way rlflow starts one (the safe path for a child that runs rlflow's code),
streaming one's output while spotting a user-error line, killing a process group, "is this pid alive",
starting a process that outlives its caller, and a keeper that ends what a process leaves running (fork_keeper).
Shared by the launchers, the DeepSpeed launcher, the reward worker, the episodes' processes, the sandbox, the vLLM
server, the resident trainer, the servers and the lease. Standard library only (and tasks.core's errors, paths and
process_wide, light as well: tests/test_layout.py).
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import functools
import os
import re
import select
import shlex
import signal
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tasks.core.errors import corrupt_in, disk_full_in, user_error_in
from tasks.core.paths import REPO_ROOT
from tasks.core.process_wide import OutputBudget, environment_variables

# ------------------------------------------------------------------------------------------------ starting one

SAFEPATH_MARK = "RLFLOW_SAFEPATH"      # PYTHONSAFEPATH was set by rlflow_first: the child removes both as it starts


def runs_rlflow(argv: list[str]) -> bool:
    """Whether argv is a Python running rlflow's packages: `-m tasks...` / `-m flows...`, or `-c` code that imports
    them. (A bridge script run by path in another environment keeps that environment's own path: not one.
    tasks/envs/adapters/*_bridge.py import none of rlflow; flows/sky_bridge.py puts the checkout first itself.)"""
    return any(a == "-m" and argv[i + 1:i + 2] and argv[i + 1].split(".")[0] in ("tasks", "flows")
               or a == "-c" and argv[i + 1:i + 2] and _IMPORTS_RLFLOW.search(argv[i + 1]) is not None
               for i, a in enumerate(argv))


_IMPORTS_RLFLOW = re.compile(r"\b(?:from|import)\s+(?:tasks|flows)\b")


def spawn(argv: list[str], env: Mapping[str, str] | None = None, *, rlflow: bool | None = None,
          **popen) -> subprocess.Popen:
    """The one way rlflow starts a child process (tests/test_layout.py holds every start to it). `env`: the child's
    environment (default: this process's). A child that runs rlflow's code (`rlflow`: None = runs_rlflow(argv);
    True for a shell that will, as a launcher's recipe) gets rlflow_first's: a working directory's own tasks/ or
    flows/ never shadows rlflow's. Every other keyword is subprocess.Popen's."""
    env = dict(os.environ if env is None else env)
    if runs_rlflow(argv) if rlflow is None else rlflow:
        env = rlflow_first(env)
    return subprocess.Popen(argv, env=env, **popen)


def run(argv: list[str], env: Mapping[str, str] | None = None, *, rlflow: bool | None = None,
        timeout: float | None = None, capture_output: bool = False, input=None,
        **popen) -> subprocess.CompletedProcess:
    """spawn, then wait for its end: subprocess.run's arguments and result (`timeout`: killed after it,
    TimeoutExpired raised)."""
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    with spawn(argv, env, rlflow=rlflow, **popen) as proc:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rlflow_first(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child Python that runs one of rlflow's modules with `-m`: the working directory is not put
    first on its sys.path (PYTHONSAFEPATH) and this checkout's root is first on PYTHONPATH instead. The marker
    tells the child that PYTHONSAFEPATH is rlflow's, not the user's: it removes both from its os.environ as it
    starts (tasks/__init__.py), so its own children (user code's) do not inherit it."""
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO_ROOT)]
    out = {**env, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), *rest])}
    if not env.get("PYTHONSAFEPATH"):         # (a user's own, unmarked, stays theirs: the child keeps it)
        out.update({"PYTHONSAFEPATH": "1", SAFEPATH_MARK: "1"})
    return out


_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def children_import_rlflow(also: str | None = None) -> Iterator[None]:
    """os.environ as rlflow_first makes it (with the folder `also` last on PYTHONPATH) while the body starts a
    child that cannot be given an environment of its own (multiprocessing's forkserver), as it was after. Keep
    the body to that start: a child user code starts meanwhile, from another thread, would inherit it too."""
    with _ENVIRON_LOCK:
        env = rlflow_first(os.environ)
        if also:
            env["PYTHONPATH"] += os.pathsep + also
        with environment_variables({k: env.get(k) for k in ("PYTHONSAFEPATH", "PYTHONPATH", SAFEPATH_MARK)}):
            yield


# ------------------------------------------------------------------------------------------------ watching one


@dataclass
class Streamed:
    code: int                     # the process's exit code (negative: killed by that signal)
    user_error: str | None        # the message of the first `RLFLOW_USER_ERROR:` line it printed
    last: list[str]               # its last lines (without line ends)
    corrupt: tuple[str, str] | None = None    # (key, message) of an `RLFLOW_CORRUPT_ARTIFACT:` line
    disk_full: str | None = None              # the message of an `RLFLOW_DISK_FULL:` line


def stream(argv: list[str], env: dict[str, str], sink: Callable[[str], object], cwd: str | Path | None = None,
           keep: int = 50, rlflow: bool | None = None, watch: Callable | None = None) -> Streamed:
    """Run argv (spawn's `rlflow`) with stdout and stderr merged, passing each line (without its line end) to
    `sink` as it comes. If we are interrupted (an exception, Ctrl-C) the process is terminated, never left behind.
    `watch(proc)`: run on a thread beside it (the local launcher's heartbeat check)."""
    proc = spawn(argv, env, rlflow=rlflow, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                 bufsize=1)
    if watch is not None:
        threading.Thread(target=watch, args=(proc,), daemon=True, name="rlflow-stage-watch").start()
    user_error, corrupt, full, last = None, None, None, collections.deque(maxlen=keep)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            sink(line)
            last.append(line)
            if user_error is None:
                user_error = user_error_in(line)
            if corrupt is None:
                corrupt = corrupt_in(line)
            if full is None:
                full = disk_full_in(line)
        return Streamed(proc.wait(), user_error, list(last), corrupt, full)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait()
        proc.stdout.close()


def kill_group(proc: subprocess.Popen, timeout: float = 5.0) -> None:
    """SIGKILL the process group of `proc` (started with start_new_session=True: it and everything it started),
    and the groups of its descendants that made groups of their own (an environment server's episodes, each a
    session: tasks/envs/runtime/isolation.own_group), then reap it and close our ends of its pipes."""
    # Once reaped, its pid (= its group id) may belong to someone else; until then (running, or ended and not
    # yet waited for) the group is its: what it started in its group is killed also where it has ended itself
    # (not what made a group of its own, which is no longer found as its descendant once it has ended).
    if _unreaped(proc):
        sigkill_groups([proc.pid, *descendant_groups(proc.pid)])
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            with contextlib.suppress(OSError):
                pipe.close()


def peek_exit(proc: subprocess.Popen) -> int | None:
    """How `proc` ended, as Popen's returncode (negative: the signal), or None while it runs; the process is not
    reaped (os.waitid's WNOWAIT), so its pid and group id stay its until it is waited for. ChildProcessError
    where someone else reaped it (SIGCHLD ignored). Without waitid (macOS), Popen.poll, which reaps."""
    if proc.returncode is not None or not hasattr(os, "waitid"):
        return proc.poll()
    got = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if got is None:
        return None
    return got.si_status if got.si_code == os.CLD_EXITED else -got.si_status


class BoundedCopy:
    """Copies what a child writes to a pipe (its stdout or stderr) to this process's descriptor 2, at most
    `limit()` bytes per budget (renew: a new one), saying once where it drops the rest. In this process, so it
    bounds everything the child and what it starts write (print, os.write, C code holding the GIL there, a
    subprocess), and what it wrote just before it died is still copied (the pipe is read to its end). The pipe is
    the copier's to close (closed under it as it waited, its number was the next worker's pipe's: it read that)."""

    def __init__(self, pipe, limit: Callable[[], int], what: str):
        self._fd, self._budget, self._what = pipe.fileno(), OutputBudget(limit), what
        self._pipe, self._closed = pipe, False   # (kept: the descriptor is the pipe object's)
        self._lock, self._taken, self._copied = threading.Lock(), 0, 0   # bytes out of the pipe; copied (or dropped)
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"rlflow-copy-{what}")
        self._thread.start()

    def renew(self) -> None:
        self._budget.renew()

    def wait(self, timeout: float) -> None:
        """Until the pipe's end was copied (the child and what it started closed it), `timeout` at most."""
        self._thread.join(timeout)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until what is in the pipe now has been copied, so that it shows before what this process says
        next: the bytes in the pipe (FIONREAD) and those the copier holds, counted (not a pause that a loaded
        machine outlasts; what a child writes after this call is not waited for). `timeout`: a copier stuck."""
        deadline = time.monotonic() + timeout
        if not self._lock.acquire(timeout=timeout):
            return
        try:
            if self._closed:
                return
            pending = array.array("i", [0])
            fcntl.ioctl(self._fd, termios.FIONREAD, pending)
            target = self._taken + pending[0]
        except OSError:
            return                               # (the pipe was closed here)
        finally:
            self._lock.release()
        while self._thread.is_alive() and self._copied < target and time.monotonic() < deadline:
            time.sleep(0.001)

    def _run(self) -> None:
        try:
            while True:
                select.select([self._fd], [], [])
                with self._lock:             # (a chunk counted as it leaves the pipe: flush's target is exact)
                    chunk = os.read(self._fd, 1 << 16)
                    self._taken += len(chunk)
                if not chunk:
                    return
                room, limit = self._budget.take(len(chunk))
                out = chunk[:room] + (f"\n[rlflow: a user's code printed more than {limit} bytes in "
                                      f"{self._what}; the rest of its output is dropped "
                                      f"(RLFLOW_USER_OUTPUT_BYTES)]\n".encode() if limit is not None else b"")
                view = memoryview(out)
                with contextlib.suppress(OSError):   # (no one reads this process's stderr: the pipe still drains)
                    while view:
                        view = view[os.write(2, view):]
                self._copied += len(chunk)
        except (OSError, ValueError):
            return
        finally:
            with self._lock, contextlib.suppress(OSError):   # (here alone: once closed, its number is another's)
                self._closed = True
                self._pipe.close()


def how_it_ended(code: int | None) -> str:
    """A child's returncode (Popen's, or multiprocessing's exitcode) as messages say it.

    >>> how_it_ended(3), how_it_ended(-9), how_it_ended(None)
    ('exit 3', 'killed by SIGKILL', 'its end not yet known')
    """
    if code is None:
        return "its end not yet known"
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _unreaped(proc: subprocess.Popen) -> bool:
    """Whether `proc`'s pid is still its (running, or a zombie not yet waited for: peek_exit leaves it so, except
    where it falls back on Popen.poll, which sets returncode as it reaps)."""
    try:
        peek_exit(proc)
    except ChildProcessError:
        return False
    return proc.returncode is None


def sigkill_groups(groups) -> None:
    """SIGKILL each process group of `groups`; one already gone (or not ours) is passed over."""
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except OSError:
            pass


def descendant_groups(root: int) -> set[int]:
    """The process groups of `root`'s descendants other than its own (read from /proc; empty elsewhere)."""
    groups = set()
    for pid in descendants(root):
        try:
            groups.add(os.getpgid(pid))
        except OSError:                                 # (gone meanwhile)
            continue
    try:
        own = os.getpgid(root)
    except OSError:
        own = root
    return groups - {own, os.getpgrp()}


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return True


def spawn_detached(argv: list[str], env: dict[str, str], watch: list[str] | None = None) -> int:
    """Start argv in a session of its own and not as our child: `sh` forks it and exits at once. The stage
    process exiting does not stop it, and neither does the end of a SkyPilot job, which kills the job's
    process tree (SkyPilot's subprocess daemon) but not what left that tree. Its output is appended to
    env["LOG"]. `watch` (a command, given the process's pid as its last argument) starts beside it in the same
    process group. Returns argv's pid. (The vLLM server and the resident trainer live like this.)"""
    script = '"$@" >>"$LOG" 2>&1 </dev/null & P=$!; echo $P'
    if watch:
        script += '; eval "exec $WATCH $P" >>"$LOG" 2>&1 </dev/null &'
        env = {**env, "WATCH": shlex.join(watch)}
    sh = spawn(["sh", "-c", script, "sh", *argv], env, rlflow=runs_rlflow(argv) or bool(watch and runs_rlflow(watch)),
               stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    pid = int(sh.stdout.readline().strip())
    sh.wait()
    return pid


def group_members(pgid: int, marker: str) -> list[int]:
    """Live processes of process group `pgid` whose command line contains `marker` (compared lower-case)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            fields = (proc / "stat").read_text().rsplit(") ", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").lower()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z" and marker in cmdline:
            out.append(int(proc.name))
    return out


def terminate_members(pgid: int | None, marker: str, wait: float) -> None:
    """SIGTERM the processes of process group `pgid` whose command line contains `marker`, SIGKILL those left
    after `wait` s. Only those processes are signalled, in case the group id was reused; never this process.
    (A process started by spawn_detached leads a group of its own: a vLLM server's, a resident trainer's.)"""
    if not pgid:
        return
    for sig, after in ((signal.SIGTERM, wait), (signal.SIGKILL, 5.0)):
        if not Path("/proc").is_dir():                  # (no /proc, e.g. macOS: the whole group)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)
        pids = [p for p in group_members(pgid, marker) if p != os.getpid()]
        for pid in pids:                # (SIGCONT after SIGTERM: a stopped process handles it now, not once continued)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + after
        while pids and any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)


@contextlib.contextmanager
def exclusive(path: Path):
    """Hold an exclusive lock on `path` (created if missing) for the block: one holder at a time across the
    processes and threads of this machine (each holder opens its own file description)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def descendants(pid: int) -> list[int]:
    """Every process started (transitively) by `pid` that is still there (a zombie too), from /proc (Linux; none
    elsewhere). Walked down from `pid` through each thread's `children` file, so it costs what the subtree holds,
    not what the machine runs (a scan of every /proc entry took ~1.5 ms for 70 processes here: ~20 µs each, and a
    GPU node lists hundreds of kernel threads; an episode's process asked it 3-4 times). Twice, the union: a
    process whose parent exits between the reads of its parent's file and its own is moved to another thread or
    up to the subreaper, both read already, and one walk misses it (a review: 1 walk in 7 under churn; two walks
    back to back: none seen). A kernel without those files (CONFIG_PROC_CHILDREN) is scanned whole. What forks
    meanwhile may be missed either way: callers that must catch it ask again (kill_until_gone)."""
    if not _children_files():
        return _descendants_scanned(pid)
    first = _walk(pid)
    seen = set(first)
    return first + [p for p in _walk(pid) if p not in seen]


def _walk(pid: int) -> list[int]:
    out, todo, seen = [], [pid], {pid}
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:                                 # (gone meanwhile)
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(n) for n in f.read().split()]
            except (OSError, ValueError):
                continue
            for kid in kids:
                if kid not in seen:
                    seen.add(kid)
                    out.append(kid)
                    todo.append(kid)
    return out


@functools.cache
def _children_files() -> bool:
    """Whether /proc has each thread's `children` file (Linux built with CONFIG_PROC_CHILDREN, as distributions'
    kernels are)."""
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


def _descendants_scanned(pid: int) -> list[int]:
    """descendants(), from every process's /proc/N/stat (where no `children` files are)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [entry for entry in Path("/proc").iterdir() if entry.name.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_until_gone(find: Callable[[], list[int]], deadline: float, pause: float = 0.001) -> bool:
    """SIGKILL every pid `find()` returns, round after round, until it returns none (True) or the monotonic
    `deadline` passes (False). What a killed process forks meanwhile is caught by a later round; a limit on
    processes (RLIMIT_NPROC, pids.max) bounds how many rounds that takes."""
    while pids := find():
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(pause)
    return True


def fork_keeper(parent_death: int = signal.SIGTERM, ignore: tuple[int, ...] = ()) -> bool:
    """Fork (Linux): the child returns True and goes on as the process; the parent stays behind as its keeper, a
    child subreaper that does nothing else and never returns. The orphans of what the child starts (a daemon
    forked away into a session of its own, no longer anyone's descendant to a kill of groups) become the keeper's
    children: reaped as they end (no zombie counts against a process limit), and killed when the child ends,
    however it ends (a crash, a SIGKILL: no cleanup of its own ran), or when the keeper's parent dies (its
    parent-death signal, `parent_death`, which it handles; the child dies with the keeper). Signals in `ignore`
    (and SIGINT) are left to the child: SIGTERM where the caller's group is asked to end gracefully. The keeper
    ends as the child did (its signal, its exit code), for whoever waits for it, and holds none of the child's
    descriptors (their ends of file are the child's alone). Without prctl (not Linux): False, no keeper.
    Used by the reward worker (tasks/scoring/worker.py) and each episode's and agent's process
    (tasks/envs/runtime/isolation.py: own_group)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(36, 1, 0, 0, 0) != 0:             # PR_SET_CHILD_SUBREAPER
            return False
    except (OSError, AttributeError):
        return False
    parent, keeper = os.getppid(), os.getpid()
    child = os.fork()
    if child == 0:                                      # (a subreaper's child is not one)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)          # PR_SET_PDEATHSIG: it ends with its keeper
        if os.getppid() != keeper:
            os._exit(1)
        return True
    status = None
    try:
        for sig in (*ignore, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        status = _keep(libc, child, parent, parent_death)
    finally:                                            # (whatever happened: never back into the caller's code)
        _end_as(status, parent_death)


class _ParentDied(Exception):
    pass


def _keep(libc, child: int, parent: int, parent_death: int) -> int | None:
    """The keeper's life (fork_keeper): reap until `child` ends (its wait status) or the parent dies (None), then
    kill every descendant left."""
    import resource

    waiting = [True]

    def died(*_) -> None:
        if waiting[0]:                  # (once, and only inside the try below: after it, a parent dying as the
            waiting[0] = False          # child ended left the keeper without the kill of what was left)
            raise _ParentDied

    status = None
    signal.signal(parent_death, died)
    try:
        libc.prctl(1, parent_death, 0, 0, 0)            # PR_SET_PDEATHSIG
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, 1 << 16)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.getppid() != parent:                      # (it died before the signal was asked for)
            raise _ParentDied
        while status is None:
            pid, code = os.waitpid(-1, 0)
            if pid == child:
                status = code
        waiting[0] = False
    except (_ParentDied, ChildProcessError):
        waiting[0] = False

    def left() -> list[int]:
        while True:                                     # (reaped first: a zombie is never gone otherwise)
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        return [p for p in descendants(os.getpid()) if alive(p)]

    kill_until_gone(left, time.monotonic() + 30.0)
    return status


def _end_as(status: int | None, parent_death: int) -> None:
    """The keeper's exit, as its child's (`status`, a wait status; None: the parent died)."""
    try:
        if status is not None and not os.WIFSIGNALED(status):
            os._exit(os.waitstatus_to_exitcode(status))
        sig = parent_death if status is None else os.WTERMSIG(status)
        try:
            signal.signal(sig, signal.SIG_DFL)          # (SIGKILL's cannot be set, nor needs to be)
        except (OSError, ValueError):
            pass
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    finally:
        os._exit(1)


def end_group(proc, grace: float = 1.0) -> None:
    """An episode's process ended with everything it started (forked children left running): its group asked to
    end (SIGTERM: a browser driver closes the browser it launched in a group of its own, as Playwright does on
    SIGTERM), then killed after `grace` seconds at most; the groups of its descendants (what it adopted: a
    daemon of its code, where it was killed before end_descendants ran) killed with it."""
    if proc.pid is None:
        return
    from multiprocessing.connection import wait

    others = descendant_groups(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        deadline, pause = time.monotonic() + grace, 0.0005
        # Its keeper (own_group) ends last, once what it kept is gone: its end, seen the moment its parent reaps
        # it (the sentinel), is nearly always the group's. Polled after that for what was left (no keeper, or
        # one killed), and with no sentinel. (A first look after a sleep of 20 ms was most of an episode's
        # process's cost; a sleep of 0.5 ms doubling still ~5 ms an episode.)
        if getattr(proc, "sentinel", None) is not None:
            wait([proc.sentinel], grace)
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):       # (nothing left of it; or own_group had not run yet)
        pass
    sigkill_groups(others)


def end_children(grace: float = 1.0) -> list[str]:
    """The multiprocessing children still running (an episode's process a failed stage left) ended with what they
    started (end_group): multiprocessing's exit handler joins each for good. Returns their names."""
    import multiprocessing

    children = multiprocessing.active_children()
    for p in children:
        end_group(p, grace)
        if p.is_alive():
            p.kill()
        p.join(1.0)
    return [f"process {p.name}" for p in children]

"""What one process shares, and why each piece exists: the state that cannot be an argument.
One concept: the state one process shares (the guards of users' code in it among it).

With the inline launcher and a caller-held trainer (the defaults), generate, reward, train and publish run in
the flow's own process, and with run.max_staleness > 0 on several of its threads at once. Most of what they use
is passed as arguments; the few things here cannot be, because Python, torch or the operating system keep them
per process: the PROCESS_WIDE lock, the random streams (rng_state, set_rng_state, seed_all), the signal handlers
(signals_kept, and the alarm of `deadline`), os._exit and os.chdir in a user's code (user_code, user_process)
and the environment variables: the only module that writes os.environ (set_default, set_variable, take, restore,
environment_variables; a stage's servers are not among them: they are its context, tasks/core/placement.py).
Not here: caches and registries kept for reuse, which live with their users (e.g. tasks/engines/trainer.py: _HELD,
tasks/scoring/functions.py: _idle). Standard library only when imported (torch: by the random streams' functions).
More: docs/internals.md (tasks/core/process_wide.py): each piece, with the reason it exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tasks.core.errors import printable

# ------------------------------------------------------------------------------------ the model-building lock

PROCESS_WIDE = threading.RLock()


# ------------------------------------------------------------------------------------------------ RNG streams

def rng_state() -> dict:
    """Every random stream training draws from (saved with a checkpoint, so a resume continues them)."""
    import torch

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        # (a resume on a machine with fewer GPUs than the one that saved: the streams of devices it has;
        # set_rng_state_all would raise for a device that is not there)
        for device, device_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)


def seed_all(seed: int) -> None:
    """Seed the streams rng_state saves (a fresh run, or a process a checkpoint did not have)."""
    import torch

    torch.manual_seed(seed)
    random.seed(seed)


# ---------------------------------------------------------------------------------------------------- signals

_FACTORY = threading.local()          # .on: this thread is making an environment
_GUARD_LOCK = threading.Lock()
_install_signal = None                # signal.signal as it was before the guard replaced it (once per process)


@contextmanager
def signals_kept() -> Iterator[None]:
    """While the body runs, signal.signal is a no-op in this thread for SIGINT and SIGTERM: an environment that
    installs its own handlers as it is made (verifiers' Environment does, for its teardown) would take the stop
    signal from the run (and cannot at all off the main thread, where thread isolation makes environments)."""
    global _install_signal
    with _GUARD_LOCK:
        if _install_signal is None:
            _install_signal = install = signal.signal

            def guarded(signum, handler):
                if getattr(_FACTORY, "on", False) and signum in (signal.SIGINT, signal.SIGTERM):
                    return signal.getsignal(signum)
                return install(signum, handler)
            signal.signal = guarded
    _FACTORY.on = True
    try:
        yield
    finally:
        _FACTORY.on = False


# ------------------------------------------------------------------------------------------- os._exit refused

_USER = threading.local()             # .pid: this thread runs a user's code (in the process of that pid)
_WHOLE = [None]                       # the pid of a process whose every thread runs users' code (user_process)
_EXIT = os._exit                      # the real one, whatever the guard makes of os._exit later


class ExitRefused(SystemExit):
    """os._exit called by a user's code running in rlflow's own process (a module imported, an environment or
    agent under env.isolation: thread): raised there instead (a SystemExit: `except Exception` does not swallow
    it), so that it fails that call, not the whole run with the exit code it chose (0 reads as success)."""

    runs_in = "rlflow's own process"

    def __str__(self) -> str:
        return f"os._exit({self.code!r}) refused: this code runs in {self.runs_in}, which it would end"


def exit_now(status: int) -> None:
    """os._exit for rlflow's own use (a second Ctrl-C, a finished run): never refused, also where a user's code
    is running on this thread when it is called (a signal handler runs on the main thread, wherever it was)."""
    _EXIT(status)


def _guarded_exit(status):
    if os.getpid() in (getattr(_USER, "pid", None), _WHOLE[0]):
        refused = ExitRefused(status)
        if os.getpid() == _WHOLE[0]:
            refused.runs_in = "the reward worker (rlflow's process for users' functions)"
        raise refused
    _EXIT(status)


class ChdirRefused(PermissionError):
    """os.chdir by a user's code in rlflow's own process (env.isolation: thread), raised there: the run's relative
    paths (store, MLflow database, config) read the process's directory; an agent's chdir moved the run's store."""

    def __str__(self) -> str:
        return (f"os.chdir({self.args[0]!r}) refused: this code runs in rlflow's own process (env.isolation: thread), "
                f"whose directory the run's relative paths read; use absolute paths, or env.isolation: process")


def _guarded(real: Callable) -> Callable:
    def call(*args, **kwargs) -> None:
        if getattr(_USER, "pid", None) == os.getpid() != _FREE[0] and not getattr(_USER, "may_chdir", False):
            raise ChdirRefused(*args, *kwargs.values())
        real(*args, **kwargs)
    return call


_guarded_chdir, _guarded_fchdir, _FREE = _guarded(os.chdir), _guarded(os.fchdir), [None]


def free_directory() -> None:
    """This process is its user's code's own (a probe's child): an os.chdir there moves nothing of rlflow's."""
    _FREE[0] = os.getpid()


def mark_user_thread() -> None:
    """This thread runs users' code from now on (a thread pool's initializer: an event loop's default executor,
    where `asyncio.to_thread` and `run_in_executor` run an environment's work)."""
    _install_guards()
    _USER.pid = os.getpid()


def user_process() -> None:
    """Every thread of this process runs users' code from now on (the reward worker, tasks/scoring/worker.py, a
    process of its own for the user's functions): os._exit in any of them raises ExitRefused, also in a thread a
    function started and left running (its exit, after the function returned, would end the worker under the
    next function and be blamed on it). What they write is bounded by the parent that reads it
    (processes.BoundedCopy)."""
    _install_guards()
    _WHOLE[0] = os.getpid()


def _install_guards() -> None:
    import posix  # (os._exit is posix._exit: a user's code may reach for either)

    with _GUARD_LOCK:
        if os._exit is not _guarded_exit:
            os._exit = _guarded_exit
        if posix._exit is not _guarded_exit:
            posix._exit = _guarded_exit
        os.chdir, os.fchdir, posix.chdir, posix.fchdir = (_guarded_chdir, _guarded_fchdir) * 2
        os.supports_fd.add(_guarded_chdir)     # (as os.chdir is: it takes a descriptor)
        if threading.Thread.start is not _noted_start:
            threading.Thread.start = _noted_start
    cap_output()


_START = threading.Thread.start


def _noted_start(self: threading.Thread) -> None:
    """Thread.start, noting a non-daemon thread that a user's code starts (USER_THREADS: not waited for at exit).
    An environment's or agent's call that left one running (daemon=False) held `rlflow record` at Python's exit
    for good, and a finished run 60 s."""
    _START(self)
    if not self.daemon and getattr(_USER, "pid", None) == os.getpid():
        with _GUARD_LOCK:
            USER_THREADS[:] = [t for t in USER_THREADS if t.is_alive()] + [self]


@contextmanager
def user_code(may_chdir: bool = False) -> Iterator[None]:
    """The body runs a user's code on this thread: an os._exit there raises ExitRefused, an os.chdir
    ChdirRefused (unless `may_chdir`: the caller puts the directory back, alone), what it prints is bounded
    (cap_output), and the entries of sys.path it removed are put back after it. Not in a child it forks (a
    fork's child calls os._exit to end itself: the pid is compared), nor in threads the user's code starts
    itself (but see mark_user_thread)."""
    _install_guards()
    before = getattr(_USER, "pid", None), getattr(_USER, "may_chdir", False)
    try:
        _USER.pid, _USER.may_chdir = os.getpid(), may_chdir
        with sys_path_kept():
            yield
    finally:
        _USER.pid, _USER.may_chdir = before


@contextmanager
def sys_path_kept() -> Iterator[None]:
    """The entries of sys.path the body removed, put back after it (also each coroutine's on a users' loop:
    isolation._awaited): `sys.path[:] = []` in an agent failed every import of rlflow's after it, and the run
    with a traceback. What it added stays."""
    path = list(sys.path)
    try:
        yield
    finally:
        if lost := [p for p in path if p not in sys.path]:
            sys.path.extend(lost)


# ------------------------------------------------------------------------------------- a user's output, bounded

USER_OUTPUT_BYTES = 4 << 20     # what users' code may print in one process ($RLFLOW_USER_OUTPUT_BYTES)


def user_output_limit() -> int:
    return int(number_from_environment("RLFLOW_USER_OUTPUT_BYTES", USER_OUTPUT_BYTES, 0, 1 << 40, whole=True))


class OutputBudget:
    """What users' code may write in one place, `limit()` at most until renewed: this process's sys.stdout and
    sys.stderr (cap_output), or a child's pipe that this process copies (processes.BoundedCopy)."""

    def __init__(self, limit: Callable[[], int] = user_output_limit):
        self._limit, self._lock = limit, threading.Lock()
        self._used, self._said, self._cap = 0, False, None

    def renew(self) -> None:
        with self._lock:
            self._used, self._said, self._cap = 0, False, None

    def take(self, n: int) -> tuple[int, int | None]:
        """Count `n` more: how many of them fit, and the limit where this is the first write that did not fit
        whole (the drop is said once per budget), else None. The limit is read once per budget, at its first
        write: a budget counted under one limit is not judged by a later one (an idle worker's stray output)."""
        with self._lock:
            if self._cap is None:
                self._cap = self._limit()
            limit = self._cap
            room = max(limit - self._used, 0)
            self._used += n
            say, self._said = n > room and not self._said, self._said or n > room
        return min(room, n), (limit if say else None)

    def fresh_lock(self) -> None:
        self._lock = threading.Lock()   # (a fork's child: the lock may have been held by a thread it lacks)


_PRINTED = OutputBudget()       # characters users' code printed in this process


class _Capped(io.TextIOBase):
    """sys.stdout or sys.stderr: what a user's code writes (a thread in user_code) counts against one budget per
    process (renewed as each episode loop starts), and past it is dropped, said once; everything else passes
    through as it is."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        if not isinstance(text, str) or getattr(_USER, "pid", None) != os.getpid():
            return self._stream.write(text)
        room, limit = _PRINTED.take(len(text))
        if room:
            self._stream.write(text[:room])
        if limit is not None:
            self._stream.write(f"\n[rlflow: a user's code printed more than {limit} characters in process "
                               f"{os.getpid()}; the rest of its output is dropped (RLFLOW_USER_OUTPUT_BYTES)]\n")
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._stream.flush()

    def fileno(self) -> int:
        return self._stream.fileno()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        """Not the stream's: the wrapper let go (io's __del__ closes what it collects) leaves the stream open."""

    @property
    def closed(self) -> bool:
        return self._stream.closed

    @property
    def encoding(self):
        return self._stream.encoding

    @property
    def errors(self):
        return self._stream.errors

    def __getattr__(self, name):
        if name.startswith("_"):             # (not yet set: a copy, an unpickling)
            raise AttributeError(name)
        return getattr(self._stream, name)


os.register_at_fork(after_in_child=_PRINTED.fresh_lock)


def renew_output_budget() -> None:
    """A new budget for what users' code prints in this process (an episode loop starts: once per stage)."""
    _PRINTED.renew()


def cap_output() -> None:
    """Bound what users' code prints through sys.stdout and sys.stderr (an environment that prints in a loop
    fills the run's log and whatever reads it) in threads running user_code. Only a stream that is a file is
    wrapped: one a user's code put there itself (a StringIO that collects a program's output) is its own. Writes
    to the file descriptors themselves (os.write, a subprocess) are not seen here; a process that is all users'
    code (the reward worker, an episode's or agent's process) writes to a pipe its parent copies from within a
    budget instead (processes.BoundedCopy), which bounds those too."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Capped):
            continue
        try:
            stream.fileno()
        except (AttributeError, OSError, ValueError):
            continue
        setattr(sys, name, _Capped(stream))


class DeadlinePassed(BaseException):
    """Raised into the body of `deadline` when its time is up (a BaseException: the body's own `except
    Exception` around its waiting does not swallow it)."""


@contextmanager
def deadline(seconds: float) -> Iterator[bool]:
    """Interrupt the body after `seconds` (SIGALRM: DeadlinePassed is raised where it is, a loop or a wait) for
    a user's code that may never end: a module's import, a task generator's item. The main thread only; elsewhere
    the body runs unwatched (yields False). An alarm the caller had set is put back, less the time spent."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield False
        return

    def passed(signum, frame):
        raise DeadlinePassed()

    before = signal.signal(signal.SIGALRM, passed)
    started = time.monotonic()
    pending, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield True
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)
        if pending:
            signal.setitimer(signal.ITIMER_REAL, max(pending - (time.monotonic() - started), 1e-3))


_HELD_EXIT: list[tuple] = []          # exit handlers users' modules registered as they were imported
USER_THREADS: list[threading.Thread] = []   # non-daemon threads users' modules or calls started
_HOLDING = threading.local()          # .on: this thread imports a user's module now
EXIT_HANDLER_SECONDS = 10.0           # the most wind_down gives each of them


def _children(thread: int | None = None) -> set[int]:
    """The children `thread` (a native thread id; None: every thread of this process) started and that are still
    there, from /proc (Linux; none elsewhere)."""
    found = set()
    for listing in Path("/proc/self/task").glob(f"{thread if thread is not None else '*'}/children"):
        try:
            found |= {int(pid) for pid in listing.read_text().split()}
        except (OSError, ValueError):
            continue            # (a thread that ended meanwhile)
    return found


def _started_at(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


_FORKED: dict[int, str] = {}    # processes users' modules forked here as they were imported (by the importing
#                                 thread): pid -> its start time (a pid reused by another process is not theirs)


def _forked_by_imports(pids: set[int]) -> None:
    import atexit

    if not _FORKED:
        atexit.register(_end_forked)
    _FORKED.update({pid: started for pid in pids if (started := _started_at(pid)) is not None})


def _end_forked() -> None:
    """Those processes still running, ended with their process groups where they lead one (at exit)."""
    for pid, started in _FORKED.items():
        if pid not in _children() or _started_at(pid) != started:      # (gone, or its pid another's now)
            continue
        try:
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@contextmanager
def user_import() -> Iterator[None]:
    """The body imports a user's module (paths.import_user), in rlflow's own process: what that may change for the
    whole run is put back or kept apart. The stop signals' handlers are put back (a module that ignored SIGINT and
    SIGTERM made Ctrl-C do nothing), and warning filters that make warnings errors removed (`simplefilter('error')`
    made MLflow's warnings errors: no trace recorded); a library's own filters and other signals' handlers stay.
    What it registers with atexit is held apart (run at exit by one handler of ours, as Python would; by
    wind_down within EXIT_HANDLER_SECONDS each), the non-daemon threads it starts are noted (USER_THREADS:
    wind_down does not wait for them), and the processes it forks are ended when this process exits (_end_forked:
    they outlived `rlflow run` before)."""
    import atexit
    import warnings

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
                } if threading.current_thread() is threading.main_thread() else {}
    filters, threads = list(warnings.filters), set(threading.enumerate())
    forked = _children(threading.get_native_id())
    with _GUARD_LOCK:
        if not isinstance(atexit.register, _Holder):
            atexit.register(_run_held)              # (the real one: where the process ends another way)
            atexit.register = _Holder(atexit.register)
    before, _HOLDING.on = getattr(_HOLDING, "on", False), True
    try:
        yield
    finally:
        _HOLDING.on = before
        USER_THREADS.extend(t for t in threading.enumerate() if t not in threads and not t.daemon)
        if started := _children(threading.get_native_id()) - forked:
            _forked_by_imports(started)
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        if any(f[0] == "error" and f not in filters for f in warnings.filters):
            warnings.filters[:] = [f for f in warnings.filters if f[0] != "error" or f in filters]
            warnings._filters_mutated()


class _Holder:
    def __init__(self, real):
        self.real = real

    def __call__(self, fn, *args, **kwargs):
        if getattr(_HOLDING, "on", False):
            _HELD_EXIT.append((fn, args, kwargs))
            return fn
        return self.real(fn, *args, **kwargs)


def _run_held(seconds: float | None = None) -> list[str]:
    """The held exit handlers, last registered first, each within `seconds` (None: unbounded); once. Returns the
    names of those that did not end in time."""
    late = []
    while _HELD_EXIT:
        fn, args, kwargs = _HELD_EXIT.pop()
        try:
            with deadline(seconds) if seconds is not None else contextlib.nullcontext():
                fn(*args, **kwargs)
        except DeadlinePassed:
            late.append(f"exit handler {getattr(fn, '__qualname__', fn)!s}")
        except BaseException:  # noqa: BLE001 - as atexit: one handler's failure does not stop the others
            pass
    return late


def wind_down(seconds: float | None, also: Callable[[], list[str]] | None = None) -> list[str]:
    """What Python's exit runs in Python: the other non-daemon threads joined (within `seconds` in all, None:
    as long as they take; not those of USER_THREADS), the exit handlers users' modules registered as they were
    imported (held apart:
    EXIT_HANDLER_SECONDS each), then the run's own (atexit: Prefect's temporary server stopped). Bounded: a
    thread or an exit handler of a user's module that never ended kept a run from exiting. Returns what was left
    running, for the caller to say."""
    import atexit

    until = time.monotonic() + seconds if seconds is not None else None
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon and t not in USER_THREADS:
            t.join(max(until - time.monotonic(), 0) if until is not None else None)
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    left += _run_held(EXIT_HANDLER_SECONDS)
    left += also() if also is not None else []       # (the CLI's: the children multiprocessing would join)
    atexit._run_exitfuncs()
    return left


def exit_wound_down(code: int, what: str, also: Callable[[], list[str]] | None = None,
                    seconds: float | None = 60.0) -> None:
    """The end of `what` (the run, a stage's process), however it ended: wind_down (`seconds`), a warning naming
    what was left running, then os._exit(code). A thread a user's module started as it was imported kept the
    process alive at Python's exit (the flow waited on a stage's process for good), and the interpreter's teardown
    costs ~2 s."""
    if left := wind_down(seconds, also):
        print(printable(f"warning: {', '.join(left[:4])} still running as {what} ended: ended with it (a user's "
                        f"module that starts a thread or registers an exit handler when imported?)"), file=sys.stderr)
    for out in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):     # (a closed pipe: the code still ends the process)
            out.flush()
    exit_now(code)


def end_forkserver_at_exit() -> None:
    """At this process's exit (atexit; wind_down runs it), its multiprocessing forkserver killed. It ends by itself
    when this process's end closes its pipe, unless a thread that a module it preloaded started (env.factory's
    module, imported there) keeps it alive: then it outlived the run, holding the run's output pipe (a `| tail`
    waited for good). Registered once."""
    import atexit

    if not _FORKSERVER_ENDED:
        _FORKSERVER_ENDED.append(True)
        atexit.register(_end_forkserver)


_FORKSERVER_ENDED: list[bool] = []


def _end_forkserver() -> None:
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


# ---------------------------------------------------------------------------------------- environment variables

def set_default(name: str, value: str) -> None:
    """`name` = `value` in this process's environment unless it is set already (a library's default: the user's
    own setting wins)."""
    os.environ.setdefault(name, value)


def set_variable(name: str, value: str) -> None:
    """`name` = `value` in this process's environment, whatever it was."""
    os.environ[name] = value


_REQUIRED = object()


def take(name: str, default=_REQUIRED):
    """`name`'s value, removed from this process's environment (read once; the children it starts must not
    inherit it). KeyError where it is not set and no `default` is given."""
    return os.environ.pop(name) if default is _REQUIRED else os.environ.pop(name, default)


def restore(name: str, value: str | None) -> None:
    """`name` back to `value`, as os.environ.get read it before: set to it, or removed where it is None."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


@contextmanager
def environment_variables(variables: Mapping[str, str | None]) -> Iterator[None]:
    """`variables` in this process's environment while the body runs (None: unset), then each as it was before
    (one that was not set is removed again), also where the body raised or changed it."""
    saved = {k: os.environ.get(k) for k in variables}
    for k, v in variables.items():
        restore(k, v)
    try:
        yield
    finally:
        for k, old in saved.items():
            restore(k, old)


def number_from_environment(name: str, default: float, low: float, high: float, whole: bool = False) -> float:
    """$name as a number in [low, high]; unset or empty: `default`. Anything else is the user's one line."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:          # (NaN fails both comparisons)
        from tasks.core.errors import UserError

        def shown(x: float) -> str:
            return str(int(x)) if whole or x == int(x) else f"{x:g}"

        raise UserError(f"{name}={raw!r} (an environment variable): expected {'a whole' if whole else 'a'} number "
                        f"from {shown(low)} to {shown(high)}, or unset for {shown(default)}")
    return value

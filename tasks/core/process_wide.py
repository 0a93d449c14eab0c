"""What one process shares, and why each piece exists: the state that cannot be an argument.

With the inline launcher and a caller-held trainer (the defaults), generate, reward, train and publish run in
the flow's own process, and with run.max_staleness > 0 on several of its threads at once. Most of what they use
is passed as arguments; the few things here cannot be, because Python, torch or the operating system keep them
per process: the PROCESS_WIDE lock, the random streams (rng_state, set_rng_state, seed_all), the signal handlers
(signals_kept, and the alarm of `deadline`) and the environment variables: the only module that writes
os.environ (set_default, set_variable, take, restore, environment_variables; a stage's servers are not among
them: they are its context, an argument, tasks/core/placement.py). Not here: caches and registries kept for
reuse, which live with their users (e.g. tasks/engines/trainer.py: _HELD, tasks/scoring/functions.py: _idle).
Standard library only when imported (torch is imported by the random streams' functions, as they run).
More: docs/internals.md (tasks/core/process_wide.py): each piece, with the reason it exists.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

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

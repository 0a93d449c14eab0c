"""What one process shares, and why each piece exists: the state that is not an argument.

With the inline launcher and a caller-held trainer (the defaults), generate, reward, train and publish run in
the flow's own process, and with run.max_staleness > 0 on several of its threads at once. Most of what they use
is passed as arguments; the few things below cannot be, because Python, torch or the operating system keep them
per process. Each sits here, once, with the reason it exists:

  PROCESS_WIDE       a lock for whatever touches process-wide torch state while another thread may too: building
                     a model (transformers' from_pretrained switches the default dtype and device for the whole
                     process while it builds; peft draws fresh adapter weights from the global RNG) and a held
                     trainer's request (its random streams are swapped in: below). Sampling into a model already
                     built never needs it (its random stream is its own: tasks/engines/hf.py).
  rng_state,         the random streams training draws from (torch's CPU and CUDA generators, Python's `random`):
  set_rng_state,     global to the process, so a trainer that shares its process with generate keeps its own
  seed_all           copy and swaps it in and out under PROCESS_WIDE (tasks/engines/resident.py), and a
                     checkpoint saves them so a resume continues them.
  signals_kept       signal handlers belong to the process: while an environment factory runs (in a thread of
                     a stage), `signal.signal` is a no-op in that thread for SIGINT and SIGTERM, so an environment
                     that installs its own handlers as it is made (verifiers' does) cannot take the run's stop
                     signal. The run's own handlers are installed by its entry point (flows/cli.py: Ctrl-C and
                     SIGTERM stop the run; flows/tune.py likewise), and an environment's child process ignores
                     Ctrl-C (tasks/envs/isolation.py: the parent handles it).
  tell_inline_stages the environment server's URL and token reach a stage as RLFLOW_ENV_SERVER / RLFLOW_ENV_TOKEN
                     in its environment (tasks/envs/server.py reads them); a stage the flow runs in its own
                     process is told the same way, so a stage has one way to find it wherever it runs.
"""

from __future__ import annotations

import os
import random
import signal
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

# ------------------------------------------------------------------------------------ the model-building lock

PROCESS_WIDE = threading.RLock()


# ------------------------------------------------------------------------------------------------ RNG streams

def rng_state() -> dict:
    """Every random stream training draws from (saved with a checkpoint, so a resume continues them)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        # (a resume on a machine with fewer GPUs than the one that saved: the streams of devices it has;
        # set_rng_state_all would raise for a device that is not there)
        for device, device_state in enumerate(state["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, device)


def seed_all(seed: int) -> None:
    """Seed the streams rng_state saves (a fresh run, or a process a checkpoint did not have)."""
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


_TOLD: dict[str, str | None] = {}     # what tell_inline_stages replaced: each variable's value before the flow run


def tell_inline_stages(variables: Mapping[str, str]) -> None:
    """Put `variables` in this process's environment, where an inline stage reads them (as a stage process
    reads its own): the environment server's URL and token, how the router launches replicas. Until
    forget_inline_stages: a flow run's servers are not the next flow run's in the same process."""
    for k in variables:
        if k not in _TOLD:
            _TOLD[k] = os.environ.get(k)
    os.environ.update(variables)


def forget_inline_stages() -> None:
    """Put back what tell_inline_stages changed (at a flow run's end: a later flow run in this process, a
    deployment's worker or a test, must not find this one's servers or its replicas' sky launch command)."""
    while _TOLD:
        k, old = _TOLD.popitem()
        if old is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = old

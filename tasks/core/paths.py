"""Places on the local disk: the cache, the checkout rlflow runs from, and the sibling virtualenvs.

vLLM and SkyPilot pin packages below what the rest of rlflow needs (Makefile), so each lives in a virtualenv
of its own beside `.venv`: `.venv-vllm` and `.venv-sky`. Their interpreters are found by one rule,
`sibling_python`: the working directory first (where `rlflow` is run from, and a SkyPilot node's workdir),
then the checkout this code was imported from (where `make setup` built them). A user's own module (a reward
function, an environment factory, an agent, a judge's parser: `module:name`) is found from the working
directory first and imported by one helper, `import_user`, under a deadline: a module that waits or loops when
imported is one line naming the field, not a preflight that never ends.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from tasks.core.errors import UserError

REPO_ROOT = Path(__file__).resolve().parents[2]     # the checkout holding tasks/ and flows/


def cache_root() -> Path:
    """Local cache: builtin models, verified copies of store folders, vLLM server state. $RLFLOW_CACHE."""
    return Path(os.environ.get("RLFLOW_CACHE", Path.home() / ".cache" / "rlflow"))


def sibling_python(venv: str) -> str | None:
    """`<dir>/<venv>/bin/python` for the first of (working directory, repository root) that has it, or None."""
    for folder in (Path.cwd(), REPO_ROOT):
        python = folder / venv / "bin" / "python"
        if python.exists():
            return str(python)
    return None


IMPORT_SECONDS = 60.0      # a user's module that takes longer to import is taken as hung ($RLFLOW_IMPORT_SECONDS)


class _ImportTimedOut(BaseException):
    """Raised into a hung import by the deadline's alarm (a BaseException: a module's own `except Exception`
    around its waiting does not swallow it)."""


def import_user(spec: str, key: str, noun: str = "callable") -> Callable:
    """`module:name` from the working directory first (user modules live where rlflow is run), imported within
    IMPORT_SECONDS: a UserError naming `key` if the module cannot be imported (it raises, calls sys.exit, or
    does not finish importing in time) or has no such callable."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    seconds = float(os.environ.get("RLFLOW_IMPORT_SECONDS") or IMPORT_SECONDS)
    try:
        with _deadline(seconds):
            module = importlib.import_module(module_name)
    except _ImportTimedOut:
        raise UserError(f"{key}: module {module_name!r} did not finish importing in {seconds:g} s (it waits or "
                        f"loops when imported: move that work into the {noun}; RLFLOW_IMPORT_SECONDS allows "
                        f"more)") from None
    except (Exception, SystemExit) as e:           # (a module that calls sys.exit when imported)
        raise UserError(f"{key}: cannot import module {module_name!r}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UserError(f"{key}: {module_name!r} has no {noun} {attr!r}")
    return fn


@contextlib.contextmanager
def _deadline(seconds: float):
    """Interrupt the block after `seconds` (SIGALRM, so the main thread only, and only when nothing else of this
    process uses that alarm; elsewhere the block runs without one: preflight, where user modules are first
    imported, runs in the main thread)."""
    usable = (threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")
              and signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, signal.SIG_IGN, None)
              and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0))
    if not usable:
        yield
        return

    def _timed_out(signum, frame):
        raise _ImportTimedOut()

    before = signal.signal(signal.SIGALRM, _timed_out)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)

"""The process reward functions run in, so that one that hangs can be killed without killing the stage
(`python -m tasks.scoring.worker`, started by tasks/scoring/functions.py, spoken to over stdin/stdout).

Protocol: length-prefixed pickles. The parent sends the setup once
`{"functions": [{"fn": "mod:f", "kwargs": {...}}, ...], "cwd": ..., "sandbox": {...}}`, the worker says
`("importing", i)` before each function's module and `("imported", None)` after the last, then answers
`("ready", None)` or `("setup_error", message)`; then per call the parent sends `(index, completions, columns)`
(columns: every other keyword of the call, TRL's convention: prompts, completion_ids, the dataset's columns,
trainer_state) and the worker answers `("ok", values, extra, metrics, dropped)` or `("error", message)`. `values`
are floats, NaN or None; `extra` holds the columns the function logged with TRL's `log_extra(column, values)`,
`dropped` the lengths of those left out, `metrics` the means of what it logged with `log_metric(name, value)`.

Imports stay light (no torch); it lives as long as its stage, and what the functions leave running ends with it
(its keeper). Only the protocol goes to the real stdout: what the functions write to fds 1 and 2 goes to a stderr
pipe the parent copies within a budget per batch (processes.BoundedCopy); os._exit in any thread is refused.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import pickle
import struct
import sys
import traceback
from dataclasses import dataclass, field

_HEADER = struct.Struct("!Q")


def send(stream, obj) -> None:
    blob = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(blob)) + blob)
    stream.flush()


def _read_exact(stream, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def receive(stream):
    (n,) = _HEADER.unpack(_read_exact(stream, _HEADER.size))
    return pickle.loads(_read_exact(stream, n))


def _one_line(e: BaseException) -> str:
    """'ValueError: cannot parse (my_rewards.py:12)': the exception and the line of the user's code it came
    from (the innermost frame outside this worker, and outside the os._exit guard that raised it)."""
    from tasks.core import process_wide

    try:
        said = str(e).strip()
    except BaseException:  # noqa: BLE001 - an exception whose __str__ raises is still the function's failure
        said = ""
    text = said.splitlines()[0] if said else ""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename not in (__file__, process_wide.__file__)]
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return (f"{type(e).__name__}: {text}"[:300] if text else type(e).__name__) + where


def _clean(values, n: int):
    """Floats (NaN kept, for the parent to count) or None; anything else is the function's error."""
    if values is None or isinstance(values, str | bytes | dict | set | frozenset) or not hasattr(values, "__iter__"):
        raise TypeError(f"returned {type(values).__name__ if values is not None else 'None'}, expected a list of "
                        f"{n} scores (one per completion)")
    values = list(values)
    if len(values) != n:
        raise ValueError(f"returned {len(values)} scores for {n} completions")
    out = []
    for j, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        try:
            if isinstance(v, str | bytes | bytearray):     # ("0.5" is text, not a score: float() would read it)
                raise TypeError
            out.append(float(v))
        except OverflowError:                              # (an int past a float's range: as a float past it, inf)
            out.append(float("inf") if v > 0 else float("-inf"))
        except (TypeError, ValueError):
            raise TypeError(f"returned {type(v).__name__} for completion {j}") from None
    return out


@dataclass(frozen=True)
class RewardState:
    """What TRL passes as `trainer_state`: every field of transformers' TrainerState, so a function reading any
    of them runs (`epoch`, `log_history`, `is_world_process_zero` raised AttributeError). `global_step`: the
    iterations trained before this batch was scored (TRL's optimiser steps at its default of one per generation
    batch); `max_steps`: the run's iterations; rlflow's run is one pass of them, so `num_train_epochs` is 1 and
    `epoch` the share done. The others keep TrainerState's defaults (no TRL logging, one process in a reward
    worker's view)."""

    global_step: int
    max_steps: int
    epoch: float | None = None
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 1
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict | None = None
    stateful_callbacks: list | None = None

    def __post_init__(self):
        if self.epoch is None:          # (frozen: set once, here)
            object.__setattr__(self, "epoch", self.global_step / self.max_steps if self.max_steps > 0 else 0.0)


def _accepted(fn) -> set[str] | None:
    """The keyword names `fn` takes, or None when it takes **kwargs (then it gets everything, as in TRL)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _call(fn, kwargs: dict, completions: list, columns: dict):
    """TRL's calling convention: every argument by keyword (prompts, completions, completion_ids, the dataset
    columns, trainer_state, log_extra, log_metric); a function without **kwargs gets the ones it names. An
    async function is run to completion."""
    extra: dict[str, list] = {}
    logged: dict[str, list[float]] = {}

    def log_extra(column: str, values: list) -> None:
        extra.setdefault(str(column), []).extend(values)

    def log_metric(name: str, value: float) -> None:
        logged.setdefault(str(name), []).append(float(value))

    n = len(completions)
    # (each function gets lists of its own: one that edits them in place changes nothing the next one, or the
    # count of its scores, sees)
    given = {**{k: list(v) if isinstance(v, list) else v for k, v in columns.items()},
             "completions": list(completions), "log_extra": log_extra, "log_metric": log_metric, **kwargs}
    accepted = _accepted(fn)
    if accepted is not None:
        given = {k: v for k, v in given.items() if k in accepted}
    values = fn(**given)
    if inspect.isawaitable(values):
        values = _loop().run_until_complete(_awaited(values))
    values = _clean(values, n)
    # a column per completion, or none: one of another length is dropped, its length said (the parent warns)
    dropped = {k: len(v) for k, v in extra.items() if len(v) != n}
    extra = {k: [_plain(x) for x in v] for k, v in extra.items() if k not in dropped}
    metrics = {k: sum(v) / len(v) for k, v in logged.items() if v}      # (NaN, inf: logged as they are, as TRL's)
    return values, extra, metrics, dropped


MAX_LOGGED_CHARS = 1 << 16      # a logged value's JSON past this is kept as its text, cut (the record stays small)


def _plain(value):
    """A logged value as the rollout record can hold it (JSON: a numpy or torch scalar as its number, anything
    else JSON cannot hold as its text), so that it can neither fail the answer nor the record written later; one
    whose JSON is longer than MAX_LOGGED_CHARS is its JSON text, cut there and saying so."""
    try:
        text = json.dumps(value, default=_as_json)
    except Exception:  # noqa: BLE001 - a cycle, a key JSON cannot take, a __str__ that raises
        try:
            text = json.dumps(str(value)[:1000])
        except Exception:  # noqa: BLE001
            return type(value).__name__
    if len(text) > MAX_LOGGED_CHARS:
        return f"{text[:MAX_LOGGED_CHARS]}… (cut: {len(text)} characters as JSON, log_extra keeps {MAX_LOGGED_CHARS})"
    return json.loads(text)


def _as_json(o):
    for method in ("item", "tolist"):            # numpy and torch scalars and arrays
        if callable(getattr(o, method, None)):
            try:
                return getattr(o, method)()
            except Exception:  # noqa: BLE001 - not that kind after all
                pass
    if isinstance(o, set | frozenset | tuple):
        return list(o)
    return str(o)[:1000]


async def _awaited(awaitable):
    return await awaitable


_LOOPS: list[asyncio.AbstractEventLoop] = []


def _loop() -> asyncio.AbstractEventLoop:
    """The worker's one event loop, kept across calls as TRL keeps its own: what an async function keeps between
    calls (an asyncio.Semaphore capping a judge's requests, an httpx.AsyncClient) is bound to the loop it was first
    used in, and a fresh loop per call (asyncio.run) failed every call after the first."""
    if not _LOOPS or _LOOPS[0].is_closed():
        _LOOPS[:] = [asyncio.new_event_loop()]
        asyncio.set_event_loop(_LOOPS[0])
    return _LOOPS[0]


class Forks:
    """The children the functions made with os.fork (counted by wrapping it), reaped after each call once ended:
    one a function forked and never waited for stayed a zombie for the worker's whole life (a process slot each,
    towards the user's process limit). Not a child that multiprocessing still tracks (its Process.join reaps it
    and reads its exit code), nor one a function waits for itself (it is gone when asked: forgotten). A child a
    function forks in one call and waits for in a later one is reaped here first (its own waitpid then finds no
    child). Programs started through subprocess are never touched (not made by os.fork: Popen waits for them).
    Orphans a function's children leave behind are the keeper's (processes.fork_keeper), which reaps them at once."""

    def __init__(self):
        self.pids: set[int] = set()
        real = os.fork

        def fork() -> int:
            pid = real()
            if pid:
                self.pids.add(pid)
            return pid

        os.fork = fork

    def reap(self) -> None:
        tracked = set()
        if self.pids and "multiprocessing" in sys.modules:
            from multiprocessing import process

            tracked = {p.pid for p in list(process._children)}   # (its Processes not yet joined: alive, or not)
        for pid in list(self.pids - tracked):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:               # (waited for by the function itself, or by multiprocessing)
                done = pid
            if done:
                self.pids.discard(pid)


def _no_timers() -> None:
    """An alarm or interval timer a function left set (signal.alarm, setitimer) is cancelled after its call: it
    would end the worker under the next function, which was blamed."""
    import signal

    for timer in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF):     # (ITIMER_REAL: alarm's too)
        signal.setitimer(timer, 0)


def die_with_parent() -> None:
    """Linux: SIGKILL this worker when the stage process that started it dies (a preempted machine, a kill):
    a hung reward function must not outlive its stage. Under its keeper (processes.fork_keeper) it ends with the
    keeper. (Not itself the subreaper of what the functions start: the code sandbox's orphans would then be its
    zombies until reaped, counted against the sandbox's process limits; commit 09da1a2. The keeper is that
    subreaper, and reaps at once.)"""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _at_home(cwd: str):
    """What puts the worker back in the run's folder after each call: a function that changes the working
    directory (os.chdir, at import or in a call) changed it for every function after it, whose relative paths then
    failed and were counted against them; one that closes its stdout or stderr (fd 1, 2) left that number free for
    the next file the worker opens (the event loop of an async function: closed by that function's next call,
    and the async one failing, blamed). (Environment variables are left as functions set them: one may set its
    own once, at its first call.)"""
    output = os.dup(2)                          # (fd 1 is fd 2 here: user prints go to the parent's stderr)
    kept = os.fstat(output)

    def home() -> None:
        try:
            os.chdir(cwd)
        except OSError:                       # (the run's folder removed under it: the functions' own business)
            pass
        for fd in (1, 2):
            if not _same(fd, kept):
                os.dup2(output, fd)
    home()
    return home


def _same(fd: int, stat: os.stat_result) -> bool:
    """Whether descriptor `fd` is still open on the file `stat` describes (not closed, nor another file since)."""
    try:
        now = os.fstat(fd)
    except OSError:
        return False
    return (now.st_dev, now.st_ino) == (stat.st_dev, stat.st_ino)


ANSWER_LOST = 86    # the worker's exit code where a function closed or replaced its answer pipe (functions._lost)


def main() -> None:
    from tasks.core.paths import working_directory_on_path
    from tasks.core.process_wide import exit_now, user_process
    from tasks.core.processes import fork_keeper

    fork_keeper()                  # (what the functions leave running ends with this worker, or its stage)
    me = os.getpid()

    def unless_forked() -> None:
        """A process a function forked and that came back here instead of ending (its code raised or returned)
        ends now: it would answer, and read requests, beside the worker."""
        if os.getpid() != me:
            exit_now(0)

    die_with_parent()
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)                  # user prints must not corrupt the protocol
    sys.stdout = sys.stderr
    user_process()                 # os._exit in any thread: refused, that call's failure (output: the parent's)
    forks = Forks()
    proto_in = os.fdopen(os.dup(0), "rb")       # (a function that closes or reads fd 0 leaves the protocol alone)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    setup = receive(proto_in)
    working_directory_on_path(setup["cwd"])       # (the user's modules there; rlflow's root ahead, as the flow has it)
    try:
        functions = []
        for i, spec in enumerate(setup["functions"]):
            unless_forked()                        # (a child a module forked as it was imported says nothing)
            send(proto_out, ("importing", i))      # (the parent's deadline is each module's: it names the one)
            module_name, _, attr = spec["fn"].partition(":")
            functions.append((getattr(importlib.import_module(module_name), attr), spec.get("kwargs") or {}))
        unless_forked()
        send(proto_out, ("imported", None))
        if setup.get("sandbox") is not None:
            from tasks.core.config import SandboxConfig
            from tasks.scoring import sandbox

            sandbox.configure(SandboxConfig.model_validate(setup["sandbox"]))
            if setup["sandbox"]["isolation"] == "bubblewrap" or setup["sandbox"]["python"]:
                sandbox.runner()       # asked for explicitly: refuse now (user error) rather than score nothing
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which names the function (sys.exit too)
        unless_forked()
        send(proto_out, ("setup_error", _one_line(e)))
        return
    unless_forked()
    home = _at_home(setup["cwd"])
    pipes = {f.fileno(): os.fstat(f.fileno()) for f in (proto_in, proto_out)}
    send(proto_out, ("ready", None))
    while True:
        try:
            index, completions, columns = receive(proto_in)
        except EOFError:
            return
        fn, kwargs = functions[index]
        try:
            answer = ("ok", *_call(fn, kwargs, completions, columns))
        except BaseException as e:  # noqa: BLE001 - the user's function (sys.exit too); the parent decides the cost
            answer = ("error", _one_line(e))
        unless_forked()
        forks.reap()
        home()
        _no_timers()
        if not all(_same(fd, stat) for fd, stat in pipes.items()):     # (the function closed rlflow's pipe: this
            exit_now(ANSWER_LOST)       # worker can answer no more; said by its exit code, not by the next call)
        try:
            send(proto_out, answer)
        except Exception as e:  # noqa: BLE001 - a value that does not pickle: that function's failure
            send(proto_out, ("error", f"returned what cannot be sent back: {_one_line(e)}"))


if __name__ == "__main__":
    main()

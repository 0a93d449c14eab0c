"""Where an episode's environment runs, behind one handle (protocol.py: EnvironmentHandle): in this process
(ThreadEnvironment, env.isolation: thread), in a process of its own (ProcessEnvironment, env.isolation: process,
the default), or on the environment server (server.py: RemoteEnvironment, env.where). The
episode loop and the server call every handle alike, through a Caller that gives each call its deadline.

    env = start_environment(cfg, make, row)      # thread or process, as env.isolation says
    env.reset(row); env.step(message); env.close(); env.state
    env.kill()                                    # what the episode loop does to a call past its deadline

In a process of its own a crash of the environment or a call that never returns costs its episode, nothing
else. The children are forked from a forkserver that imported the environment's module, so an episode's
process costs a fork and its pickles (~12 ms here), not a new interpreter.
More: docs/internals.md (tasks/envs/runtime/isolation.py): the forkserver, and what it pays once for every episode.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from tasks.core.process_wide import (
    end_forkserver_at_exit,
    renew_output_budget,
    set_variable,
    sys_path_kept,
    take,
    user_code,
    user_output_limit,
)
from tasks.core.processes import (
    BoundedCopy,
    children_import_rlflow,
    descendant_groups,
    end_group,
    fork_keeper,
    how_it_ended,
    sigkill_groups,
)
from tasks.envs.runtime.loops import BLOCKED, blocked_for, started_loop
from tasks.envs.runtime.protocol import as_step, environment, factory_of, state_of
from tasks.envs.runtime.tools import tool_schemas

if TYPE_CHECKING:
    from tasks.core.config import Config

_context, _warm = None, False
_warming = threading.Lock()              # (episodes start from many threads, each calling warm_up)
PREPARE = "RLFLOW_FORKSERVER_CONFIG"     # the config the forkserver prepares for (warm_up: for its start only)


def _forkserver(cfg: Config):
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        # (this module first: it prepares the forkserver as it is imported there, importing the others)
        ctx.set_forkserver_preload(["tasks.envs.runtime.isolation", "tasks.core.config", "tasks.envs.adapters.kinds",
                                    "transformers.utils",        # (tool schemas: get_json_schema)
                                    (cfg.env.factory or cfg.env.agent).partition(":")[0]])
        _context = ctx
    return _context


def warm_up(cfg: Config) -> None:
    """Start the forkserver, let it import its modules and prepare for `cfg`'s environment (once per process: one
    forkserver serves a process, prepared for the first config's), so that no episode's env.timeout_seconds
    pays for it. Before each start: one that has ended (killed, out of memory) is started here again, this way
    (multiprocessing's restart would put the working directory first on its path: a user's `tasks` package)."""
    global _warm
    with _warming:
        if _warm and _forkserver_alive():
            return
        if _warm:
            print("the environments' forkserver had ended: starting it again", file=sys.stderr, flush=True)
        proc = _forkserver(cfg).Process(target=_noop)
        # The forkserver starts with this process's os.environ (it takes no env of its own), and its `-c` would
        # put the working directory first on its path: for this one start rlflow's root is first and the working
        # directory last (env.factory's module, preloaded, is found there). It drops the safe path as it starts
        # (tasks/__init__.py), so the episodes it forks do not inherit it; nor the config it prepares for (PREPARE).
        with children_import_rlflow(also=os.getcwd()):
            set_variable(PREPARE, json.dumps({"parent": os.getpid(), "config": cfg.model_dump(mode="json")}))
            try:
                proc.start()
            finally:
                take(PREPARE, None)
        proc.join()
        _warm = True
        end_forkserver_at_exit()


def _noop() -> None: pass


def _forkserver_alive() -> bool:
    """Whether this process's forkserver runs, asked without reaping it (WNOWAIT: multiprocessing's own check at
    the next start sees an ended one and starts another)."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", -1)   # (-1: not known here)
    try:
        return pid == -1 or pid is not None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _prepare_forkserver(given: Any) -> None:
    """In the forkserver, as it starts (before it forks anything): pay here, once, what each episode's process
    would pay on first use. Best effort: what fails here is paid by each child, where its error is the episode's."""
    from multiprocessing import spawn

    given = json.loads(given)
    if given["parent"] != os.getppid():       # (another child of that process, started while it was set)
        return
    # A child of the forkserver runs the parent's __main__ again as __mp_main__ before its target (spawn.prepare:
    # a script run by path, a `-m` module): its imports and top-level code, 7 ms for `rlflow`, 33 ms for
    # `-m tasks.generate`, a user's script whatever it costs, in every episode. The children's targets
    # (_serve, agents._child) and their arguments are rlflow's and plain data: nothing of __main__ is needed.
    def prepare(data: dict) -> None:
        _prepare({k: v for k, v in data.items() if k not in ("init_main_from_name", "init_main_from_path")})

    _prepare = spawn.prepare
    spawn.prepare = prepare
    try:
        from tasks.core.config import Config
        from tasks.core.errors import UserError
        from tasks.core.paths import import_user
        from tasks.envs.adapters.kinds import tool_names
        from tasks.envs.runtime.tools import schema

        cfg = Config.model_validate(given["config"])        # (pydantic's first validation: ~1 ms)
        if not cfg.env.factory:
            return
        try:
            made = import_user(cfg.env.factory, "env.factory")
        except UserError:              # (found on a path the parent added as it ran: each child imports it)
            return
        if not inspect.isclass(made):           # (a function makes it: what it makes is known only by making one)
            return
        # The tools as an instance has them (a method bound to it, a staticmethod as it is), from the class alone:
        # no instance is made here (what __init__ starts, threads or connections, every child would inherit).
        anyone = object()
        tools = [inspect.getattr_static(made, name).__get__(anyone, made) for name in tool_names(made)]
        listed = inspect.getattr_static(made, "tools", None)
        tools += list(listed) if isinstance(listed, list | tuple) else []
        for tool in tools:
            try:
                schema(tool)
            except Exception:  # noqa: BLE001, S112 - not a tool (a protocol method without a docstring), or a bad one
                continue
    except Exception as e:  # noqa: BLE001 - preparing is an optimisation: each child does it again
        print(f"rlflow: the environments' forkserver was not prepared ({why(e)}); each episode pays it",
              file=sys.stderr)


def own_group() -> None:
    """First thing in an episode's process: a session and process group of its own, so that what its code does to
    its group (os.killpg(0, SIGTERM)) reaches itself and what it started, not the run, and its end (end_group)
    takes what it started with it. It still ends with its parent (the forkserver, which ends with the stage): a
    run killed as a group takes its episodes with it as before. It adopts orphans (a child subreaper): a daemon
    its code forked away into a session of its own is its child, ended with it (end_descendants). Behind it
    stays its keeper (processes.fork_keeper, in its group: the process the forkserver made), which ends what it
    left running where it ended without end_descendants (a crash, a SIGKILL: before 2026-12-05 init's, for
    good), and where the forkserver dies."""
    parent = os.getppid()
    os.setsid()
    kept = fork_keeper(signal.SIGHUP, ignore=(signal.SIGTERM,))     # (SIGTERM: end_group's, for the episode)
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if not kept:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux; with a keeper: set, to it)
        libc.prctl(36, 1)                  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    if not kept and (os.getppid() != parent or parent == 1):    # (its parent ended before the line above)
        os._exit(1)


def own_output(out) -> None:
    """Second thing in an episode's or agent's process: its descriptors 1 and 2 become `out`, a pipe whose other
    end its parent copies from within a budget (output_copy): print, os.write, C code and the processes it
    starts are all bounded, where a wrapper of sys.stdout saw print alone (before 2026-12-04)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()


def output_copy(ctx, what: str):
    """(a copier of what a child of `ctx` writes, within $RLFLOW_USER_OUTPUT_BYTES, to this process's stderr;
    the pipe's end for the child's own_output): the parent closes that end once the child has started."""
    out, into = ctx.Pipe(duplex=False)
    return BoundedCopy(out, user_output_limit, what), into


def end_descendants() -> None:
    """Last thing in an episode's or agent's process: what its code started in groups of their own (a daemon, a
    browser it did not close) killed, so that nothing outlives the episode (nor holds its output's pipe: the
    stage's copier waited for it); its own group is the stage's to end (end_group)."""
    sigkill_groups(descendant_groups(os.getpid()))


def _serve(conn, out, cfg_dump: dict, row: dict, cwd: str, path: list[str]) -> None:
    """The child: make the environment, then answer calls until `close`; then end what its code left running."""
    own_group()
    own_output(out)                    # (what it writes, however: bounded by the parent's copier)
    os.chdir(cwd)
    sys.path[:] = path                                     # what the parent can import, the child can
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the parent's to handle
    try:
        _answer(conn, cfg_dump, row)
    finally:
        end_descendants()


def _answer(conn, cfg_dump: dict, row: dict) -> None:
    """Make the environment, then answer calls until `close` (in the episode's process)."""
    from tasks.core.config import Config

    loop = asyncio.new_event_loop()

    def run(value):
        return loop.run_until_complete(value) if inspect.isawaitable(value) else value

    try:
        cfg = Config.model_validate(cfg_dump)
        env = environment(cfg, factory_of(cfg, preflight=False)(row), row)
        conn.send(("ok", tool_schemas(env)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent as the episode's failure
        conn.send(("error", why(e)))
        return
    while True:
        try:
            op, arg = conn.recv()
        except EOFError:
            return
        try:
            if op == "reset":
                reply: Any = run(env.reset(arg))
            elif op == "step":
                value = run(env.step(arg))
                try:
                    st = as_step(value)
                except TypeError as e:
                    conn.send(("invalid", str(e)))
                    continue
                reply = (st.observation, st.reward, st.done, st.info)
            else:                                          # close
                if callable(getattr(env, "close", None)):
                    run(env.close())
                end_descendants()                          # (before the answer: the stage then ends its group)
                conn.send(("ok", state_of(getattr(env, "instance", env))))
                return
            conn.send(("ok", reply))
        except BaseException as e:  # noqa: BLE001
            try:
                conn.send(("error", why(e)))
            except Exception:  # noqa: BLE001 - (the reply itself did not pickle)
                return


def start_environment(cfg: Config, make, row: dict, opened: Callable[[Any], None] | None = None):
    """One episode's environment as env.isolation says: a ProcessEnvironment (its child made it; `opened`: told
    of it before it is made), or a ThreadEnvironment around what `make` (protocol.factory_of) made. What the
    stage's episode loop and the environment server both open."""
    if cfg.env.isolation == "process":
        return ProcessEnvironment.start(cfg, row, opened)
    return ThreadEnvironment(environment(cfg, make(row), row))


class ThreadEnvironment:
    """An environment in this process, driven by the protocol (an `async def` method's coroutine is returned as
    it is: the Caller runs it on its event loop). Its state is read before it closes; nothing can end a call
    that hangs (a thread cannot be killed: its thread is left behind, a daemon)."""

    def __init__(self, env: Any):
        self.env = env
        self.instance = getattr(env, "instance", env)      # (the user's object, inside an adapter)
        self.tool_schemas: list[dict] = tool_schemas(env)
        self.state: dict | None = None

    def reset(self, row: dict):
        return self.env.reset(row)

    def step(self, message: dict):
        return self.env.step(message)

    def close(self, failed: bool = False):
        """After a failed episode too: nothing else would end it."""
        self.state = state_of(self.instance)
        close = getattr(self.env, "close", None)
        return close() if callable(close) else None

    def kill(self) -> None:
        """Nothing to kill in this process."""


def why(e: BaseException) -> str:
    """An exception as one line: its type and the first line of its text (EnvironmentFailed's text is both)."""
    if isinstance(e, EnvironmentFailed) and str(e):
        return str(e).splitlines()[0]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip()


class EnvironmentFailed(RuntimeError):
    """The environment's (or agent's) own exception, raised in its process: the message is its type and text."""


def user_error_of(e: BaseException):
    """The UserError an environment's or agent's code raised in its own process (EnvironmentFailed "UserError:
    text", as `why` sent it): the config's mistake, the stage's to raise. None for any other failure."""
    from tasks.core.errors import UserError

    said = "UserError: "
    if isinstance(e, EnvironmentFailed) and str(e).startswith(said):
        return UserError(str(e)[len(said):])
    return None


def as_failure(e: BaseException) -> BaseException:
    """A user's code's exception in a thread of the stage, as that call's failure: what is not an Exception (sys.exit,
    KeyboardInterrupt, BaseException) is EnvironmentFailed ("SystemExit: 0"), not the stage's or a loop's end."""
    return e if isinstance(e, Exception) else EnvironmentFailed(why(e))


class EnvironmentDied(RuntimeError):
    """The environment's process ended without answering (a crash, a kill)."""


class InvalidReply(TypeError):
    """What the environment returned is not what the protocol takes (protocol.as_step's message)."""


class ProcessEnvironment:
    """The protocol's methods, each a call into the child."""

    def __init__(self, proc, conn, copy: BoundedCopy):
        self.proc, self.conn, self.copy = proc, conn, copy
        self._killing, self._killed = threading.Lock(), False
        self.tool_schemas: list[dict] = []
        self.state: dict | None = None

    @classmethod
    def start(cls, cfg: Config, row: dict, opened: Callable[[Any], None] | None = None) -> ProcessEnvironment:
        """The child started, then its environment made there. `opened` is told of it once started: a caller
        whose time runs out while the environment's __init__ hangs can kill it."""
        warm_up(cfg)                       # (once per process: the stage and the server have called it already)
        ctx = _forkserver(cfg)
        parent, child = ctx.Pipe()
        dump = cfg.model_dump(mode="json")
        copy, into = output_copy(ctx, "an environment's process")
        try:
            proc = ctx.Process(target=_serve, args=(child, into, dump, row, os.getcwd(), list(sys.path)))
            proc.start()
        finally:
            child.close()
            into.close()
        env = cls(proc, parent, copy)
        if opened is not None:
            opened(env)
        env.tool_schemas = env._reply()
        return env

    def _reply(self):
        from multiprocessing.connection import wait

        try:
            # its end as well as its answer: a process it forked may hold the pipe open after it died
            if self.conn not in wait([self.conn, self.proc.sentinel]) and not self.conn.poll():
                raise EOFError
            kind, value = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(1.0)
            raise EnvironmentDied(f"the environment's process died ({how_it_ended(self.proc.exitcode)})") from None
        if kind == "error":
            raise EnvironmentFailed(value)
        if kind == "invalid":
            raise InvalidReply(value)
        return value

    def _call(self, op: str, arg: Any):
        self.conn.send((op, arg))
        return self._reply()

    def reset(self, row: dict) -> list[dict]:
        return self._call("reset", row)

    def step(self, message: dict):
        return self._call("step", message)

    def close(self, failed: bool = False) -> None:
        """Its state, then its end; after a failed episode only its end (it may be hung or gone)."""
        try:
            if not failed:
                self.state = self._call("close", None)
        finally:
            self.kill()

    def kill(self) -> None:
        """Once, whoever asks (its episode's timeout, the stage abandoning it, its close): a second caller returns."""
        with self._killing:
            if self._killed:
                return
            self._killed = True
        end_group(self.proc)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)
        self.conn.close()
        self.copy.wait(1.0)           # (its last lines on the console before the episode's end is said)


class Caller:
    """Environment calls with a deadline: sync ones on a daemon thread each (at most `concurrency` at once),
    coroutines on one event loop thread. The episode loop's and the environment server's."""

    def __init__(self, concurrency: int):
        renew_output_budget()                 # (what users' code prints in this loop's threads: bounded anew)
        self.slots = threading.Semaphore(concurrency)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.made = threading.Lock()
        self.freeing = threading.Lock()

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The one event loop (made by the first call that needs it: calls come from many threads at once, and an
        episode's reset and steps must share their loop, as an async environment's futures belong to one)."""
        with self.made:
            if self.loop is None:
                self.loop, _ = started_loop("env-loop")
            return self.loop

    @staticmethod
    def blocked(done: Future) -> str | None:
        """Why a call past its time (`done`) did not end, if the loop it awaits on has run nothing for at least
        half of that time: a coroutine blocks it (every call on it fails so while it does). The loop is kept: an
        episode's reset and steps share theirs, and the others on it go on once it is let go."""
        loop = getattr(done, "on_loop", None)
        stopped = None if loop is None else blocked_for(loop, max((time.monotonic() - done.started) / 2, 2.0))
        return None if stopped is None else BLOCKED.format("the environments' coroutines", stopped)

    def start(self, fn, *args) -> Future:
        """fn(*args) on a thread of its own once a slot is free (waited for there, not here: calls that hang for
        good, holding every slot, never stop the caller from timing out the others); a call cancelled while it
        waits is never made."""
        done: Future = Future()

        def run() -> None:
            self.slots.acquire()
            with self.freeing:
                done.holds, done.started = True, time.monotonic()    # (its episode's time runs from here)
            if not done.set_running_or_notify_cancel():     # (its episode timed out waiting: not made)
                self.give_up(done)
                return
            try:
                with user_code():                           # (an os._exit in it: that call's failure)
                    value = fn(*args)
                if inspect.isawaitable(value):
                    done.on_loop = self._loop()
                    value = asyncio.run_coroutine_threadsafe(_awaited(value), done.on_loop).result()
                done.finished = time.monotonic()
                done.set_result(value)
            except BaseException as e:  # noqa: BLE001 - the episode's failure, reported by wait()
                done.finished = time.monotonic()
                done.set_exception(as_failure(e))
            finally:
                self.give_up(done)

        threading.Thread(target=run, daemon=True, name="env-call").start()
        return done

    def give_up(self, done: Future) -> None:
        """The call's slot freed: it returned, or ran out of its episode's time (cancelled first: one waiting for a
        slot is never made; one in a thread cannot be stopped and is written off: hung for good, a few held every
        slot for the caller's life, the streaming sampler's a whole run, and every later call timed out waiting)."""
        with self.freeing:
            held, done.holds = getattr(done, "holds", False), False
        if held:
            self.slots.release()

    def stop(self) -> None:
        """The loop stopped, what the environments left open on it aborted first (UsersLoop.end)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.end)


async def _awaited(value):
    try:
        with sys_path_kept():
            return await value
    except (SystemExit, KeyboardInterrupt) as e:     # (out of the loop's run_forever otherwise: its thread ends)
        raise as_failure(e) from None


if PREPARE in os.environ and sys.argv == ["-c"]:        # (this module, imported in the forkserver warm_up started)
    _prepare_forkserver(take(PREPARE))

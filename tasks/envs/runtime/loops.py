"""The event loop users' coroutines run on in rlflow's own process (env.isolation: thread): the environments'
(isolation.Caller) and the agents' (agents.Threads), each on a daemon thread of its own. A UsersLoop takes calls
from any thread, ends with what users left open on it aborted, and notes when it last ran (`beat`, every
BEAT_SECONDS): a coroutine that blocks it (time.sleep, a synchronous client) stops every coroutine on it, which
is the user's code's doing, not a stalled environment's (stopped_for).

    loop, thread = started_loop("agents")      # users_loop() run by run_forever on a daemon thread
    stopped_for(loop)                          # seconds it has run nothing
    blocked_for(loop, seconds)                 # that, if at least `seconds` and it does not run when asked
"""

from __future__ import annotations

import asyncio
import heapq
import threading
import time

from tasks.core.process_wide import mark_user_thread, user_code

BEAT_SECONDS = 0.5
BLOCKED = ("the event loop {} share (env.isolation: thread) ran nothing for {:.0f} s: a coroutine made a blocking "
           "call (time.sleep, a synchronous client); await it, use asyncio.to_thread, or env.isolation: process")


class UsersLoop(asyncio.SelectorEventLoop):
    """The loop of users' coroutines, safe against their objects' finalizers. An object left behind by an ended
    episode is collected on whichever thread the garbage collector runs, and some close themselves on the loop
    running there: openai's AsyncClient.__del__ schedules its aclose() on the endpoint's server loop, which then
    touches this loop's transports (call_soon, a reader removed) from that thread. Not thread-safe, that lost
    this loop's wake-ups and timers (seen: an agent's asyncio.sleep never ended, every episode of the lockstep
    round waited for it until env.timeout_seconds). Such calls from another thread are handed to this loop's
    own thread here (call_soon_threadsafe, which also wakes it)."""

    def _elsewhere(self) -> bool:
        return self._thread_id is not None and self._thread_id != threading.get_ident()

    def call_soon(self, callback, *args, context=None):
        if self._elsewhere():
            return self.call_soon_threadsafe(callback, *args, context=context)
        return super().call_soon(callback, *args, context=context)

    def call_at(self, when, callback, *args, context=None):
        if not self._elsewhere():
            return super().call_at(when, callback, *args, context=context)
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        self.call_soon_threadsafe(self._schedule, timer)
        return timer

    def _schedule(self, timer: asyncio.TimerHandle) -> None:
        if not timer.cancelled():
            timer._scheduled = True
            heapq.heappush(self._scheduled, timer)

    def end(self) -> None:
        """Stop, the connections still open on this loop aborted first (called on its thread: by
        call_soon_threadsafe). A client an agent or environment never closed would otherwise stay open, and be
        closed by its finalizer later, on a loop stopped or closed by then: a traceback printed for each ('Event
        loop is closed') and its socket open until collected."""
        for transport in list(self._transports.values()):
            if not transport.is_closing():
                transport.abort()
        self.call_soon(self._stop_once_closed, time.monotonic() + 5.0)

    def _stop_once_closed(self, deadline: float) -> None:
        """Stop once every connection's socket is closed (by its own callbacks, run here). A close begun on
        another thread (a StreamWriter's finalizer, on the garbage collector's thread) marks its transport
        closing at once but hands its last steps to this loop a moment later: a loop stopped in between never ran
        them, and that socket stayed open for good (seen under load: about one test run in six). Past
        `deadline`, what is still open is closed here."""
        left = [t for t in list(self._transports.values()) if getattr(t, "_sock", None) is not None]
        if left and time.monotonic() < deadline:
            self.call_later(0.005, self._stop_once_closed, deadline)
            return
        for transport in left:
            try:
                transport._sock.close()
            except (AttributeError, OSError):
                pass
        self.stop()

    def _here(self, change, *args):
        """A change of the selector's registrations, made on this loop's thread."""
        if not self._elsewhere():
            return change(*args)
        self.call_soon_threadsafe(change, *args)
        return True

    def _add_reader(self, fd, callback, *args):
        return self._here(super()._add_reader, fd, callback, *args)

    def _remove_reader(self, fd):
        return self._here(super()._remove_reader, fd)

    def _add_writer(self, fd, callback, *args):
        return self._here(super()._add_writer, fd, callback, *args)

    def _remove_writer(self, fd):
        return self._here(super()._remove_writer, fd)


def users_loop() -> asyncio.AbstractEventLoop:
    """A new event loop for users' coroutines (UsersLoop), whose default executor's threads (asyncio.to_thread,
    run_in_executor) are marked as running users' code too (process_wide.user_code)."""
    from concurrent.futures import ThreadPoolExecutor

    loop = UsersLoop()
    loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="users-executor",
                                                 initializer=mark_user_thread))
    return loop


def run_forever(loop) -> None:
    """A shared event loop's thread: runs until loop.stop(). sys.exit() in a task an episode's coroutine started
    (gather, create_task) leaves run_forever with its SystemExit (that task ends with it, so the episode's own
    coroutine fails: _awaited); the loop goes on for the other episodes instead of its thread ending. An os._exit
    in a coroutine raises there (process_wide.user_code): this loop runs users' code only."""
    with user_code():
        while True:
            try:
                loop.run_forever()
                return
            except (SystemExit, KeyboardInterrupt):
                continue


def started_loop(name: str) -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    """users_loop() run by run_forever on a daemon thread called `name`, noting when it last ran."""
    loop = users_loop()
    loop.beat = time.monotonic()
    loop.call_soon(_beating, loop)
    thread = threading.Thread(target=run_forever, args=(loop,), daemon=True, name=name)
    thread.start()
    return loop, thread


def _beating(loop) -> None:
    loop.beat = time.monotonic()
    loop.call_later(BEAT_SECONDS, _beating, loop)


def stopped_for(loop) -> float:
    """Seconds `loop` (started_loop's) has run nothing: 0 while it runs, growing while a coroutine blocks it."""
    return max(0.0, time.monotonic() - loop.beat - BEAT_SECONDS)


def blocked_for(loop, at_least: float) -> float | None:
    """stopped_for(loop) if at least `at_least` and the loop does not run a callback within a second more (the
    whole process stalled, a SIGSTOP, a frozen VM: its thread gets that second to run first); else None."""
    if stopped_for(loop) < at_least:
        return None
    ran = threading.Event()
    try:
        loop.call_soon_threadsafe(ran.set)
    except RuntimeError:                         # (closed)
        return None
    return None if ran.wait(1.0) else stopped_for(loop)

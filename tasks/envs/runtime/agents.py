"""Agents as users write them: `env.agent: module:function`, trained unchanged.

    async def run(row, base_url, api_key):                  # or a plain def
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
        reply = await client.chat.completions.create(model="policy", messages=[...], tools=[...])
        ...
        return reward                                       # or (reward, info), or None: reward.functions decide

For each dataset row, `params.n` episodes (a GRPO group), each one call of the agent with an API key of its own
on the stage's endpoint (endpoint.py), which records every model call's tokens under that key. An agent that
fails (raises, hangs, dies) costs only its episode. An episode becomes samples without re-tokenizing: one chain
of calls is one sample, the turns merged; several chains are several samples sharing the episode's return.
More: docs/internals.md (tasks/envs/runtime/agents.py): limits, failures, and how calls become samples, in full.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tasks.core.contracts import Rollout, Sampled, SamplingParams, SamplingSession
from tasks.core.errors import UserError
from tasks.core.paths import import_user
from tasks.core.process_wide import renew_output_budget, user_code
from tasks.core.processes import end_group, how_it_ended
from tasks.envs.runtime.calls import Call, EpisodeLog
from tasks.envs.runtime.endpoint import Endpoint
from tasks.envs.runtime.isolation import (
    EnvironmentFailed,
    _awaited,
    as_failure,
    end_descendants,
    output_copy,
    own_group,
    own_output,
    user_error_of,
    warm_up,
)
from tasks.envs.runtime.loops import BLOCKED, blocked_for, started_loop

if TYPE_CHECKING:
    from tasks.core.config import Config

EPISODE_SEED = 7_919_993        # episode e's calls sample with seed params.seed + e * EPISODE_SEED (+ call offsets)
POLL = 0.01
UNWIND_SECONDS = 5.0      # what a stopped runner waits for its agents' coroutines to unwind (Threads.stop)
START_SECONDS = 60.0      # an agent's process given this long to start running (a fork, under load) before its
                          # env.timeout_seconds begin: its own time is counted from then (Processes)


def agent_of(cfg: Config):
    """env.agent imported: one line naming it if it cannot be, or is not a function of (row, base_url, api_key);
    an agent with a `check` attribute (an integration's: tasks/envs/adapters/verifiers_v04.py) has it check
    env.kwargs."""
    spec = cfg.env.agent
    fn = import_user(spec, "env.agent")
    try:
        inspect.signature(fn).bind("row", "base_url", "api_key", **cfg.env.kwargs)
    except TypeError as e:
        raise UserError(f"env.agent: {spec} cannot be called as run(row, base_url, api_key"
                        f"{', **env.kwargs' if cfg.env.kwargs else ''}): {e}") from None
    except ValueError:
        pass                                   # (no signature to read: a builtin or extension callable)
    if callable(accepts := getattr(fn, "check", None)):        # an integration's own check of its arguments
        accepts(**cfg.env.kwargs)
    return fn


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:                      # (an int past a float's range: 10**400)
        return False


@dataclass
class Unfit:
    """What an agent in a process of its own returned that outcome() refused there: its words."""

    why: str


def outcome(value: Any) -> tuple[float | None, dict]:
    """What an agent returned, as (reward, info): a real number (numpy's too), (number, dict), or None."""
    if isinstance(value, Unfit):
        raise TypeError(value.why)
    if value is None:
        return None, {}
    info: Any = {}
    given = value
    if isinstance(value, tuple | list) and len(value) == 2:
        value, info = value
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value) or \
            not isinstance(info, dict):
        def named(v) -> str:
            if isinstance(v, int) and not isinstance(v, bool) and not _finite(v):
                return "an int too large for a float"
            return repr(v) if isinstance(v, float) and not math.isfinite(v) else type(v).__name__   # (nan, inf)
        shown = f"({named(value)}, {named(info)})" if given is not value else named(value)
        raise TypeError(f"the agent returned {shown}: expected a finite number, (number, dict) or None")
    return float(value), info


# ------------------------------------------------------------------------------------------ running agents

@dataclass
class Running:
    """One agent at work: its episode's key, and how to learn its end or end it."""

    index: int
    key: str
    started: float
    done: Any = None          # () -> bool
    result: Any = None        # () -> value (raises the agent's failure)
    kill: Any = None          # () -> None
    blocked: Any = None       # () -> str | None: why it ran out of its time, if not its own doing


class Threads:
    """env.isolation: thread — `async def` agents on one event loop thread (as environments' coroutines), plain
    functions on a daemon thread each. One past its time is cancelled (a coroutine) or left behind (a blocked
    thread), its episode failed either way. A coroutine that blocks (a synchronous sleep or request inside it)
    holds up every agent on the loop until it returns: an episode past its time on a loop that has run nothing
    for half of it fails with BLOCKED (not a timeout, which an environment's server is retried for: every
    stage of such a run was retried three times and then blamed the environment) and the episodes after them
    get a loop of their own. env.isolation: process keeps one agent's block from the others'."""

    def __init__(self, fn, kwargs: dict, timeout: float = math.inf):
        renew_output_budget()                 # (what the agents print in this stage's threads: bounded anew)
        self.fn, self.kwargs, self.timeout = fn, kwargs, timeout
        # A loop of its own per stage: what agents keep on it (a client, its pooled connections to this stage's
        # endpoint) ends with it. Kept across stages, a client of a later endpoint that got the same port back
        # reused connections of the earlier one and waited on them (seen: episodes hung until their timeout).
        self.loop, self.thread = started_loop("agents")
        self.left: list[asyncio.AbstractEventLoop] = []       # loops given up as blocked (_blocked)
        self.swapping = threading.Lock()

    def _blocked(self, loop: asyncio.AbstractEventLoop) -> str | None:
        """BLOCKED if `loop` has run nothing for half the timeout at least (an agent past its time: held up by it);
        the episodes started after this get a new one."""
        if (stopped := blocked_for(loop, max(self.timeout / 2, 2.0))) is None:
            return None
        with self.swapping:               # (the old one runs on for the agents still on it: ended at stop)
            if loop is self.loop:
                self.left.append(loop)
                self.loop, self.thread = started_loop("agents")
        return BLOCKED.format("the agents", stopped)

    def start(self, run: Running, row: dict, base_url: str) -> None:
        from concurrent.futures import Future

        loop = self.loop
        run.blocked = lambda: self._blocked(loop)
        if inspect.iscoroutinefunction(self.fn):
            future = asyncio.run_coroutine_threadsafe(_awaited(self.fn(row, base_url, run.key, **self.kwargs)),
                                                      self.loop)
        else:
            future = Future()

            def call() -> None:
                try:
                    with user_code():
                        value = self.fn(row, base_url, run.key, **self.kwargs)
                    if inspect.isawaitable(value):
                        value = asyncio.run_coroutine_threadsafe(_awaited(value), self.loop).result()
                    future.set_result(value)
                except BaseException as e:  # noqa: BLE001 - the episode's failure
                    future.set_exception(as_failure(e))

            threading.Thread(target=call, daemon=True, name="agent").start()
        run.done, run.result, run.kill = future.done, future.result, future.cancel

    def stop(self) -> None:
        """The agents still on the loop cancelled and let unwind before it stops: a client cancelled mid-request
        closes its connection then, where a loop stopped at once left requests half sent and the endpoint's server
        waiting on them (seen: its shutdown hung on two such connections)."""
        async def unwind() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                if not t.cancelling():          # (a killed one is unwinding already: cancelled again, its
                    t.cancel()                  # `finally` would be cut short)
            if tasks:
                await asyncio.wait(tasks, timeout=UNWIND_SECONDS / 2)     # (one that will not: left as it is)
        try:
            asyncio.run_coroutine_threadsafe(unwind(), self.loop).result(UNWIND_SECONDS)
        except Exception:  # noqa: BLE001 - the loop held by an agent that blocks it: left to its daemon thread
            self.loop.call_soon_threadsafe(self.loop.end)
            return
        finally:
            for loop in self.left:            # (each ends once its blocking coroutine lets it)
                loop.call_soon_threadsafe(loop.end)
        self.loop.call_soon_threadsafe(self.loop.end)       # (what the agents left open aborted first: UsersLoop.end)
        self.thread.join(UNWIND_SECONDS)
        if not self.thread.is_alive():
            self.loop.close()


class Processes:
    """env.isolation: process — each agent in a child of the forkserver (isolation.py) that imported its module;
    a hung or crashed one is killed or found dead, nothing else is touched."""

    def __init__(self, cfg: Config):
        from tasks.envs.runtime.isolation import _forkserver

        warm_up(cfg)
        self.ctx, self.cfg = _forkserver(cfg), cfg

    def start(self, run: Running, row: dict, base_url: str) -> None:
        warm_up(self.cfg)                  # (a forkserver that has ended is started again the safe way)
        parent, child = self.ctx.Pipe(duplex=False)
        copy, into = output_copy(self.ctx, "an agent's process")
        spawned, run.started = time.monotonic(), math.inf      # (its clock waits for its process to run: `ended`)
        try:
            proc = self.ctx.Process(target=_child, args=(child, into, self.cfg.env.agent,
                                                         dict(self.cfg.env.kwargs), row, base_url, run.key,
                                                         os.getcwd(), list(sys.path)))
            proc.start()
        finally:
            child.close()
            into.close()
        got: list = []

        def done() -> bool:
            if got:
                return True
            alive = proc.is_alive()                     # (read first: what it sent before it ended is in the pipe)
            try:
                while parent.poll():
                    kind, value = parent.recv()
                    if kind == "running":               # the agent's own time starts now, not its process's start
                        run.started = time.monotonic()
                        continue
                    got.append((kind, value))
                    return True
            except (EOFError, OSError):
                got.append(("died", None))
                return True
            if not alive:
                got.append(("died", None))
                return True
            if run.started == math.inf and time.monotonic() - spawned > START_SECONDS:
                got.append(("error", f"the agent's process did not start within {START_SECONDS:.0f} s"))
                return True
            return False

        def result():
            kind, value = got[0]
            end_group(proc)                             # (what it started and left running; its answer is in)
            if kind == "error" and proc.is_alive():     # (one that never started: no group of its own yet)
                proc.kill()
            proc.join(5)
            copy.wait(1.0)
            if kind == "died":
                raise RuntimeError(f"the agent's process died ({how_it_ended(proc.exitcode)})")
            if kind == "error":
                raise EnvironmentFailed(value)
            return value

        def kill() -> None:
            end_group(proc)
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            parent.close()
            copy.wait(1.0)

        run.done, run.result, run.kill = done, result, kill

    def stop(self) -> None:
        pass


def _child(conn, out, spec: str, kwargs: dict, row: dict, base_url: str, key: str, cwd: str,
           path: list[str]) -> None:
    """The agent's process: run it once, send back ("ok", value) or ("error", "Type: text")."""
    from tasks.envs.runtime.isolation import why

    own_group()
    own_output(out)                    # (what it writes, however: bounded by the parent's copier)
    conn.send(("running", None))
    os.chdir(cwd)
    sys.path[:] = path
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        value = import_user(spec, "env.agent")(row, base_url, key, **kwargs)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
        end_descendants()                  # (before the answer: the stage then ends its group)
        try:        # (a plain number across the pipe: a tensor's pickle needs its sender alive, "died (exit 0)")
            conn.send(("ok", value if value is None else outcome(value)))      # (None: set_reward's return)
        except TypeError as e:
            conn.send(("ok", Unfit(str(e))))
    except BaseException as e:  # noqa: BLE001 - the episode's failure, reported to the parent
        end_descendants()
        try:
            conn.send(("error", why(e)))
        except Exception:  # noqa: BLE001
            pass


def run_agents(cfg: Config, table: dict[int, dict], rows: list[int], session: SamplingSession,
               params: SamplingParams, policy: str) -> tuple[list[Rollout], Sampled]:
    """params.n episodes of each row of `rows` by the agent env.agent names, against an endpoint on
    `session` that serves `policy`."""
    ec = cfg.env
    fn = agent_of(cfg)
    episodes = [(g, r) for g, r in enumerate(rows) for _ in range(params.n)]
    logs: dict[int, EpisodeLog] = {}
    outcomes: dict[int, tuple[float | None, dict, str | None]] = {}
    runner = Processes(cfg) if ec.isolation == "process" else Threads(fn, dict(ec.kwargs), ec.timeout_seconds)
    with Endpoint(cfg, session, policy, params) as ep:
        ep.lockstep = True                    # rounds of every waiting call, batched (endpoint.py)
        pending = list(range(len(episodes)))
        running: list[Running] = []
        try:
            def begin(i: int) -> Running:
                run = Running(i, ep.open(i, (params.seed + i * EPISODE_SEED) % (2 ** 63)), time.monotonic())
                runner.start(run, dict(table[episodes[i][1]]), ep.base_url)
                return run

            while pending and len(running) < ec.concurrency:
                running.append(begin(pending.pop(0)))
            while running:
                time.sleep(POLL)
                still = []
                for run in running:
                    if (result := ended(run, ep.episodes[run.key], ec.timeout_seconds)) is None:
                        still.append(run)
                        continue
                    outcomes[run.index], logs[run.index] = result, ep.close(run.key)
                running = still
                while pending and len(running) < ec.concurrency:      # (an ended agent's slot, refilled first)
                    running.append(begin(pending.pop(0)))
                ep.settle()
        finally:
            for run in running:
                run.kill()
            runner.stop()
    records = []
    for i, (g, r) in enumerate(episodes):
        records += episode_records(cfg, logs[i], outcomes[i], g, r, table[r], session.tokenizer)
    return records, Sampled([], ep.load_seconds, ep.sampling_seconds)


def ended(run: Running, log: EpisodeLog, timeout: float) -> tuple[float | None, dict, str | None] | None:
    """The outcome of an agent that has ended (reward, info, error), or None while it is at work; one past its
    `timeout` (seconds of its own, from when it runs: its process's start-up and its calls' time not counted)
    is killed and failed."""
    if run.done():
        try:
            value = run.result()
        except UserError:
            raise                     # the config's mistake, as the agent found it: every episode would fail so
        except BaseException as e:  # noqa: BLE001 - costs only this episode
            if (mistake := user_error_of(e)) is not None:
                raise mistake from None                                     # (raised in its own process)
            return None, {}, _why(e)
        try:
            reward, info = outcome(value)
        except TypeError as e:                  # (what it returned: it did not raise)
            return None, {}, str(e)
        return reward, info, None
    if time.monotonic() - run.started - log.busy_seconds() > timeout:
        why = run.blocked() if run.blocked is not None else None
        run.kill()
        return None, {}, why or "the agent did not return within env.timeout_seconds"
    return None


def _why(e: BaseException) -> str:
    from tasks.envs.runtime.isolation import why

    text = str(e) if isinstance(e, RuntimeError) and str(e) else why(e)
    return f"agent raised {text}" if not text.startswith("the agent") else text


# ------------------------------------------------------------------------------------------ calls -> samples

def chains(calls: list[Call]) -> list[list[int]]:
    """The episode's calls grouped into chains: a call joins the chain whose last call it extends token for
    token (Call.extends, checked here on the ids themselves), else starts one."""
    out: list[list[int]] = []
    for i, c in enumerate(calls):
        j = c.extends
        home = next((ch for ch in out if j is not None and ch[-1] == j), None)
        if home is not None:
            prev = calls[j]
            head = prev.prompt_ids + prev.completion_ids
            if c.prompt_ids[:len(head)] == head:
                home.append(i)
                continue
        out.append([i])
    return out


def episode_records(cfg: Config, log: EpisodeLog, result: tuple[float | None, dict, str | None], group: int,
                    row: int, data: dict, tokenizer) -> list[Rollout]:
    reward, info, error = result
    dropped = None
    if error is not None and log.limited is not None:
        error, dropped = None, error      # (it raised after a call its limits refused: truncated, as environments;
                                          # no return unless it set one: scored as missing, never as 0)
    if reward is None and error is None:
        reward = log.reward
    info = {**log.info, **info}
    calls = log.calls
    columns = {k: v for k, v in data.items() if k != cfg.data.prompt_column}
    prompt, turns = _transcript(calls, data, cfg)
    if prompt is None:
        prompt = tokenizer.decode(calls[0].prompt_ids, skip_special_tokens=True)
    truncated = log.limited is not None
    state = {"agent_info": info, "calls": len(calls), **({"limited": log.limited} if log.limited else {}),
             **({"agent_error": dropped} if dropped else {})}
    if not calls:                         # (no model call: a one-token placeholder, nothing to train)
        return [Rollout(group=group, row=row, prompt=prompt, prompt_ids=[tokenizer.eos_token_id], completion="",
                        completion_ids=[], logprobs=[], truncated=truncated, columns=columns, mask=[], turns=turns,
                        turn_rewards=[], env_return=reward if error is None else None, env_error=error,
                        env_state=state)]
    out = []
    for k, chain in enumerate(chains(calls)):
        first = calls[chain[0]]
        ids: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []          # (streamed calls: a gap's tokens carry the version of the call before)
        drawn: list[tuple[float, float]] = []      # each token's (temperature, top_p)
        end = first.prompt_ids
        for i in chain:
            c = calls[i]
            gap = c.prompt_ids[len(end):] if i != chain[0] else []
            ids += gap + c.completion_ids
            mask += [0] * len(gap) + [1] * len(c.completion_ids)
            logprobs += [0.0] * len(gap) + c.logprobs
            if c.versions is not None:
                versions += (versions[-1:] or c.versions[:1]) * len(gap) + c.versions
            drawn += [_drawn_at(c, cfg)] * (len(gap) + len(c.completion_ids))
            end = c.prompt_ids + c.completion_ids
        run = (cfg.generate.temperature, cfg.generate.top_p)
        last = calls[chain[-1]]
        out.append(Rollout(group=group, row=row, prompt=prompt, prompt_ids=first.prompt_ids,
                           completion=tokenizer.decode(ids, skip_special_tokens=True), completion_ids=ids,
                           logprobs=logprobs, truncated=truncated or last.truncated, columns=columns, mask=mask,
                           turns=turns, turn_rewards=[], env_return=reward if error is None else None,
                           env_error=error, env_state=state, part=k,
                           versions=versions if len(versions) == len(ids) else None,
                           temperatures=[t for t, _ in drawn] if any(d != run for d in drawn) else None,
                           top_ps=[p for _, p in drawn] if any(d != run for d in drawn) else None))
    return out


def _drawn_at(c: Call, cfg: Config) -> tuple[float, float]:
    """The (temperature, top_p) a call's tokens were drawn at: its own where its request asked for them, else the
    run's. A greedy call (temperature 0, env.endpoint.temperature's low end) records the logprobs of the whole
    distribution at temperature 1 (tasks/engines/hf.py), so its tokens are scored at (1, 1)."""
    t = c.temperature if c.temperature is not None else cfg.generate.temperature
    p = c.top_p if c.top_p is not None else cfg.generate.top_p
    return (1.0, 1.0) if t == 0 else (t, p)


def _transcript(calls: list[Call], data: dict, cfg: Config) -> tuple[Any, list[dict] | None]:
    """The episode's prompt (its first call's messages, or the row's prompt when it made none) and its final
    transcript after that prompt (what reward functions get as the completion): the last call's conversation
    and reply."""
    if not calls:
        return data.get(cfg.data.prompt_column, ""), []
    first, last = calls[0], calls[-1]
    if first.messages is None:                     # raw completions: the prompt as text, no messages
        return None, None
    whole = [*(last.messages or []), *([last.reply] if last.reply else [])]
    n = len(first.messages)
    if whole[:n] == first.messages:
        return first.messages, whole[n:]
    return first.messages, whole


def agent_metrics(records: list[Rollout]) -> dict[str, float]:
    """agent/*: calls per episode, how many episodes split into several samples, samples per episode."""
    leads = [r for r in records if not r.part]
    n = max(len(leads), 1)
    split = {(r.group, id(r.env_state)) for r in records if r.part}
    return {"agent/calls_mean": sum((r.env_state or {}).get("calls", 0) for r in leads) / n,
            "agent/split_episodes": float(len(split)),
            "agent/samples_per_episode": len(records) / n,
            "agent/limited": float(sum("limited" in (r.env_state or {}) for r in leads))}

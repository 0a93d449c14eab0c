"""Multi-turn episodes: the sampling engine and the environments take turns, tokens in and tokens out.

    records, sampled = run_episodes(cfg, table, rows, policy, path, tokenizer, engine, params)

For each dataset row, `params.n` episodes (a GRPO group: episodes of the same task), each with an environment
of its own (env.factory). Turn by turn, every episode still going asks the engine for one completion of its
whole context, the prompt's ids followed by every id so far. The engine returns token ids and behaviour
logprobs, and nothing is ever re-tokenised. The model's message goes to its environment, and the observation
comes back as the tokens the chat template renders for it: the rendering of a dummy turn followed by the
observation, minus the rendering of the dummy turn. The end of the assistant's turn (`<|im_end|>\\n`, or what the
template closes a turn with) comes first, less what the model already wrote (its EOS). The record's `mask` is
1 on the model's tokens and 0 on the observation's. Their logprobs are 0 and they never enter the loss.

Each episode's environment lives in a process of its own (env.isolation: process; tasks/envs/isolation.py), or
in this one (thread). Its calls (reset, step, close) are made from threads of their own; in-process `async def`
ones run on one event loop thread. An episode's calls share env.timeout_seconds, and env.concurrency of them
are in flight at once. A call that raises, returns garbage, runs out of time or whose process dies ends that
episode only. It keeps the tokens so far and gets no return (`env_error`, counted in env/errors). A process
past its deadline is killed; in thread mode a hung call's thread is left behind, as a daemon.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tasks.core.models import load_tokenizer, policy_path
from tasks.core.rollout import Rollout
from tasks.engines.sampling import Sampled, SamplingParams, sample_rollouts, sampling_engine
from tasks.envs.isolation import (
    EnvironmentDied,
    EnvironmentFailed,
    InvalidReply,
    ProcessEnvironment,
    start_environment,
    warm_up,
    why,
)
from tasks.envs.protocol import as_messages, as_step, factory_of, state_of
from tasks.envs.server import RemoteEnvironment, ServerGone, ServerRefused
from tasks.envs.tools import parse_tool_calls

if TYPE_CHECKING:
    from tasks.core.config import Config

TURN_SEED = 1_000_033          # turn t samples with seed params.seed + t * TURN_SEED
_ELSEWHERE = (ProcessEnvironment, RemoteEnvironment)      # in another process: their state comes back from close


@dataclass
class Episode:
    group: int
    row: int
    data: dict
    env: Any = None
    schemas: list[dict] = field(default_factory=list)     # the tools' JSON schemas, as the prompt declares them
    prompt: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    error: str | None = None
    budget: float = 0.0          # seconds its environment's calls may still take (env.timeout_seconds in all)
    state: dict | None = None

    def fail(self, why: str) -> None:
        self.error, self.done = why[:500], True


class _Caller:
    """Environment calls with a deadline: sync ones on a daemon thread each (at most `concurrency` at once),
    coroutines on one event loop thread."""

    def __init__(self, concurrency: int):
        self.slots = threading.Semaphore(concurrency)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.made = threading.Lock()

    def _loop(self) -> asyncio.AbstractEventLoop:
        """The one event loop (made by the first call that needs it: calls come from many threads at once, and an
        episode's reset and steps must share their loop, as an async environment's futures belong to one)."""
        with self.made:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
                threading.Thread(target=self.loop.run_forever, daemon=True, name="env-loop").start()
            return self.loop

    def start(self, fn, *args) -> Future:
        done: Future = Future()

        def run() -> None:
            try:
                value = fn(*args)
                if inspect.isawaitable(value):
                    value = asyncio.run_coroutine_threadsafe(_awaited(value), self._loop()).result()
                done.finished = time.monotonic()
                done.set_result(value)
            except BaseException as e:  # noqa: BLE001 - the episode's failure, reported by wait()
                done.finished = time.monotonic()
                done.set_exception(e)
            finally:
                self.slots.release()

        self.slots.acquire()
        threading.Thread(target=run, daemon=True, name="env-call").start()
        return done

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)


async def _awaited(value):
    return await value


def _each(caller: _Caller, episodes: list[Episode], what: str, call, fails: bool = True) -> list[Any]:
    """call(episode) for every episode at once; per episode its value, or None after marking it failed (when
    `fails`: a close that fails does not undo its episode). Each call may take what is left of its episode's
    budget, and what it took is charged to that episode alone: waiting here for another episode's slow call
    costs an episode nothing."""
    t0 = time.monotonic()
    futures = [caller.start(call, e) for e in episodes]
    out = []
    for e, f in zip(episodes, futures):
        try:
            value = f.result(timeout=max(t0 + e.budget - time.monotonic(), 0.0))
            e.budget -= getattr(f, "finished", time.monotonic()) - t0
            out.append(value)
            continue
        except (ServerGone, ServerRefused) as ex:
            if fails:
                raise                                          # the whole stage's failure: retried by the flow
            why = str(ex)
        except TimeoutError:
            why = f"{what} did not return within env.timeout_seconds"
            if callable(getattr(e.env, "kill", None)):        # (its own process: ended now)
                e.env.kill()
        except Exception as ex:  # noqa: BLE001 - costs only this episode
            e.budget -= getattr(f, "finished", time.monotonic()) - t0
            why = _failure(what, ex)
        if fails:
            e.fail(why)
        out.append(None)
    return out


def _failure(what: str, ex: Exception) -> str:
    if isinstance(ex, EnvironmentFailed):            # raised in the environment's process: "Type: text"
        return f"{what} raised {ex}"
    if isinstance(ex, EnvironmentDied | InvalidReply):
        return f"{what}: {ex}"
    return f"{what} raised {why(ex)}"


# ------------------------------------------------------------------------------------------ tokens

class Renderer:
    """Token ids of prompts and observations as the tokenizer's chat template renders them."""

    DUMMY = "rlflow-dummy-turn"
    TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": DUMMY}]

    def __init__(self, tokenizer, max_prompt_length: int):
        self.tok, self.max_prompt_length = tokenizer, max_prompt_length
        self.eos_text = tokenizer.eos_token or ""
        self._heads: dict[str, tuple[str, str]] = {}

    def _template(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                            tokenize=False)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        text = self._template(messages, tools, True)
        return self.tok(text, add_special_tokens=False)["input_ids"][-self.max_prompt_length:]

    def observation(self, messages: list[dict], tools: list[dict] | None, ended_with_eos: bool) -> list[int]:
        """The end of the assistant's turn (less the EOS it wrote), the observation, the next turn's header."""
        key = repr(tools)
        if key not in self._heads:
            prefix = self._template(self.TURN, tools, False)
            if self.DUMMY not in prefix:
                raise ValueError("the chat template does not render an assistant message's content")
            closing = prefix[prefix.rindex(self.DUMMY) + len(self.DUMMY):]
            self._heads[key] = (prefix, closing)
        prefix, closing = self._heads[key]
        full = self._template(self.TURN + messages, tools, True)
        if not full.startswith(prefix):
            raise ValueError("the chat template renders earlier turns differently once more follow; the "
                             "observation's tokens cannot be appended")
        if ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self.tok(closing + full[len(prefix):], add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ episodes

def sample(cfg: Config, ds, rows: list[int], policy: str, params: SamplingParams) -> tuple[list[Rollout], Sampled]:
    """What generate and evaluate call: episodes with env.factory, else one completion per prompt
    (tasks/engines/sampling.py: sample_rollouts)."""
    if not cfg.env.factory:
        return sample_rollouts(cfg, ds, rows, policy, params)
    path = policy_path(cfg, policy)
    table = {r: ds[r] for r in set(rows)}
    return run_episodes(cfg, table, rows, policy, path, load_tokenizer(path), sampling_engine(cfg), params)


def run_episodes(cfg: Config, table: dict[int, dict], rows: list[int], policy: str, path: str, tokenizer,
                 engine, params: SamplingParams) -> tuple[list[Rollout], Sampled]:
    ec = cfg.env
    # (imported here too: a process environment's forkserver imports it; a server's environments, only there)
    make = None if ec.remote() else factory_of(cfg)
    render = Renderer(tokenizer, cfg.generate.max_prompt_length)
    episodes = [Episode(group=g, row=r, data=dict(table[r])) for g, r in enumerate(rows) for _ in range(params.n)]
    caller = _Caller(ec.concurrency)
    remote = ec.remote()
    if remote:
        from tasks.envs.server import server_of

        server_of(cfg)                 # no server given: one line, before any episode
    elif ec.isolation == "process":
        warm_up(cfg)
    for e in episodes:
        e.budget = ec.timeout_seconds
    load_seconds = sampling_seconds = 0.0
    try:
        def begin(e: Episode) -> list[dict]:
            if remote:
                e.env = RemoteEnvironment.start(cfg, e.data)
                e.schemas = e.env.tool_schemas
            else:
                e.env, e.schemas = start_environment(cfg, make, e.data)
            return e.env.reset(e.data)

        for e, messages in zip(episodes, _each(caller, episodes, "reset", begin)):
            if e.error is None:
                try:
                    e.prompt = as_messages(messages, "reset's messages")
                    e.prompt_ids = render.prompt(e.prompt, e.schemas)
                except (TypeError, ValueError) as ex:
                    e.fail(f"reset: {ex}")
            if not e.prompt_ids:           # (a failed reset: a one-token placeholder, no completion, no reward)
                e.prompt_ids = [tokenizer.eos_token_id]
        for turn in range(ec.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            budgets = [min(params.max_new_tokens, ec.max_tokens - len(e.ids)) for e in active]
            sampled = engine.generate(policy, path, tokenizer, [e.prompt_ids + e.ids for e in active], SamplingParams(
                n=1, max_new_tokens=max(budgets), temperature=params.temperature, top_p=params.top_p,
                seed=params.seed + turn * TURN_SEED))
            load_seconds += sampled.load_seconds
            sampling_seconds += sampled.sampling_seconds
            messages = []
            for e, s, budget in zip(active, sampled.samples, budgets):
                ids = s.completion_ids[:budget]
                ended = not s.truncated and len(ids) == len(s.completion_ids)
                e.ids += ids
                e.mask += [1] * len(ids)
                e.logprobs += s.logprobs[:budget]
                text = tokenizer.decode(ids, skip_special_tokens=True)
                content, calls = parse_tool_calls(text) if e.schemas else (text, [])
                message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                e.turns.append(message)
                messages.append((message, ended))
                if len(e.ids) >= ec.max_tokens:
                    e.truncated = True
            steps = _each(caller, active, "step", lambda e: e.env.step(e.turns[-1]))
            for e, raw, (_, ended) in zip(active, steps, messages):
                if e.error is not None:
                    continue
                try:
                    st = as_step(raw)
                except TypeError as ex:
                    e.fail(f"step: {ex}")
                    continue
                e.rewards.append(st.reward)
                e.turns += st.observation
                if st.done or e.truncated or turn == ec.max_turns - 1 or not st.observation:
                    e.done = True
                    continue
                try:
                    obs = render.observation(st.observation, e.schemas, ended)
                except (TypeError, ValueError) as ex:
                    e.fail(f"step's observation: {ex}")
                    continue
                if len(e.ids) + len(obs) >= ec.max_tokens:      # no room left for another model turn
                    e.truncated = e.done = True
                    continue
                e.ids += obs
                e.mask += [0] * len(obs)
                e.logprobs += [0.0] * len(obs)
    finally:
        _close(caller, episodes)
    return [_record(cfg, e, tokenizer) for e in episodes], Sampled([], load_seconds, sampling_seconds)


def _close(caller: _Caller, episodes: list[Episode]) -> None:
    """Keep each environment's state (env_state), then close it; a process environment whose episode failed
    is killed instead (it may be hung or gone)."""
    process = [e for e in episodes if isinstance(e.env, _ELSEWHERE)]
    for e in process:
        if e.error is not None:
            e.env.kill()
    for e in episodes:
        if e.env is not None and not isinstance(e.env, _ELSEWHERE):
            e.state = state_of(getattr(e.env, "instance", e.env))
    live = [e for e in episodes if e.env is not None and callable(getattr(e.env, "close", None))
            and not (isinstance(e.env, _ELSEWHERE) and e.error is not None)]
    for e in live:
        e.budget = max(e.budget, 0.0) + 5.0
    _each(caller, live, "close", lambda e: e.env.close(), fails=False)
    for e in live:
        if isinstance(e.env, _ELSEWHERE):
            e.state = e.env.state
    caller.stop()


def _record(cfg: Config, e: Episode, tokenizer) -> Rollout:
    ret = None
    if e.error is None and e.rewards:
        ret = sum(e.rewards) if cfg.env.returns == "sum" else e.rewards[-1]
    elif e.error is None:
        ret = 0.0
    return Rollout(group=e.group, row=e.row, prompt=e.prompt, prompt_ids=e.prompt_ids,
                   completion=tokenizer.decode(e.ids, skip_special_tokens=True), completion_ids=e.ids,
                   logprobs=e.logprobs, truncated=e.truncated,
                   columns={k: v for k, v in e.data.items() if k != cfg.data.prompt_column},
                   mask=e.mask, turns=e.turns, turn_rewards=e.rewards, env_return=ret, env_error=e.error,
                   env_state=e.state)


def episode_metrics(records: list[Rollout]) -> dict[str, float]:
    """env/*: turns, returns, failures and the model's share of the tokens."""
    n = max(len(records), 1)
    returns = [r.env_return for r in records if r.env_return is not None]
    return {"env/episodes": float(len(records)),
            "env/turns_mean": sum(sum(m.get("role") == "assistant" for m in r.turns or []) for r in records) / n,
            "env/return_mean": sum(returns) / max(len(returns), 1),
            "env/errors": float(sum(r.env_error is not None for r in records)),
            "env/truncated": float(sum(r.truncated for r in records)),
            "env/model_tokens_mean": sum(sum(r.mask or []) for r in records) / n}

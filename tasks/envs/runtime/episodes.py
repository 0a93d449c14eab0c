"""Multi-turn episodes: the sampling engine and the environments take turns, tokens in and tokens out.

    with open_session(cfg, policy) as session:          # (tasks/engines/sampling.py) every turn shares it
        records, sampled = run_episodes(cfg, table, rows, session, params)

For each dataset row, `params.n` episodes (a GRPO group: episodes of the same task), each with an environment
of its own (env.factory). Turn by turn, every episode still going asks the engine for one completion of its
whole context; the observation comes back as the tokens the chat template renders for it, and nothing is ever
re-tokenised. The record's `mask` is 1 on the model's tokens and 0 on the observation's.
Each episode's environment is behind one handle (tasks/envs/runtime/isolation.py) wherever it runs; a call that fails
ends that episode only (`env_error`).
More: docs/internals.md (tasks/envs/runtime/episodes.py): how observations are rendered, where environments run,
deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tasks.core.contracts import EnvironmentHandle, Rollout, Sampled, SamplingParams, SamplingSession
from tasks.core.data import message_text
from tasks.core.errors import UserError
from tasks.core.placement import placement_of
from tasks.envs.runtime.isolation import (
    Caller,
    EnvironmentDied,
    EnvironmentFailed,
    InvalidReply,
    ThreadEnvironment,
    start_environment,
    user_error_of,
    warm_up,
    why,
)
from tasks.envs.runtime.protocol import as_messages, as_step, factory_of
from tasks.envs.runtime.rendering import Renderer
from tasks.envs.runtime.server import RemoteEnvironment, ServerGone, ServerRefused, server_of
from tasks.envs.runtime.tools import parse_tool_calls

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.placement import Services

TURN_SEED = 1_000_033          # turn t samples with seed params.seed + t * TURN_SEED


@dataclass
class Episode:
    group: int
    row: int
    data: dict
    env: EnvironmentHandle | None = None
    schemas: list[dict] = field(default_factory=list)     # the tools' JSON schemas, as the prompt declares them
    prompt: list[dict] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)     # generate.streaming: per token of ids, the policy's
    turns: list[dict] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    timings: list[dict] = field(default_factory=list)     # per turn: {"model": s, "env": s}
    done: bool = False
    truncated: bool = False
    model_turns: int = 0
    error: str | None = None
    budget: float = 0.0          # seconds its environment's calls may still take (env.timeout_seconds in all)
    state: dict | None = None
    abandoned: bool = False      # a call of it ran out of time: an environment it opens after that is killed
    hung: Future | None = None   # that call (in a thread: it may still run, on the environment, written off)

    def fail(self, why: str) -> None:
        self.error, self.done = why[:500], True

    def opened(self, env: EnvironmentHandle) -> None:
        """Its environment's process, started (before it is made: isolation.ProcessEnvironment.start). Its call
        may have run out of time already, a loaded machine starting the process late: then it is killed here."""
        self.env = env
        if self.abandoned:
            env.kill()


def _each(caller: Caller, episodes: list[Episode], what: str, call, fails: bool = True) -> list[Any]:
    """call(episode) for every episode at once; per episode its value, or None after marking it failed (when
    `fails`: a close that fails does not undo its episode). Each call may take what is left of its episode's
    budget, and what it took is charged to that episode alone: waiting here for another episode's slow call
    costs an episode nothing."""
    t0 = time.monotonic()
    futures = [caller.start(call, e) for e in episodes]
    try:
        return _results(caller, episodes, futures, t0, what, fails)
    except BaseException:
        _abandon(episodes, futures)
        raise


def _abandon(episodes: list[Episode], futures: list[Future]) -> None:
    """The stage ends here (the config's mistake, a server gone, an interrupt) while other episodes' calls still
    run: each is failed and its environment killed (one its call opens later is killed as it opens:
    Episode.opened), none waited for. Left running, their processes kept the run from exiting: the interpreter
    joins the children it started, and theirs waited for their next call for good."""
    for e, f in zip(episodes, futures):
        if not f.done():
            f.cancel()
            e.abandoned = True                                 # (before e.env is read: Episode.opened)
            e.fail("the stage ended before its call returned")
            if e.env is not None:
                try:
                    e.env.kill()
                except Exception:  # noqa: BLE001 - (gone already): the stage's own error is the one raised
                    pass


def _results(caller: Caller, episodes: list[Episode], futures: list[Future], t0: float, what: str,
             fails: bool) -> list[Any]:
    """_each's values, in the episodes' order. A call's time runs from when it got its slot (Caller.start): one
    waiting for a slot that a call of this batch holds is charged nothing for the wait (with env.concurrency 1
    and a hung call, the others timed out queued behind it); while none of them holds one, from t0 or the last
    moment one of them freed its slot."""
    out: list[Any] = [None] * len(episodes)
    pending, freed = set(range(len(episodes))), t0
    while pending:
        now, holding = time.monotonic(), any(hasattr(futures[i], "started") for i in pending)
        deadlines = {}
        for i in sorted(pending):
            start = getattr(futures[i], "started", None if holding else freed)
            if futures[i].done() or (start is not None and now >= start + episodes[i].budget):
                pending.discard(i)
                out[i] = _outcome(caller, episodes[i], futures[i], what, fails)
                freed = time.monotonic()
            elif start is not None:
                deadlines[i] = start + episodes[i].budget
        if pending:
            wait([futures[i] for i in pending], return_when=FIRST_COMPLETED,
                 timeout=min([0.25, *(d - now for d in deadlines.values())]))
    return out


def _outcome(caller: Caller, e: Episode, f: Future, what: str, fails: bool) -> Any:
    """One call's value, or None after failing its episode (when `fails`): it raised, or is past its time."""
    if f.done():
        try:
            value = f.result(timeout=0)
            e.budget -= f.finished - f.started
            return value
        except (ServerGone, ServerRefused) as ex:
            if fails:
                raise                                          # the whole stage's failure: retried by the flow
            why = str(ex)
        except UserError:
            raise                     # the config's mistake (an adapter's check): every episode would fail so
        except Exception as ex:  # noqa: BLE001 - costs only this episode
            if (mistake := user_error_of(ex)) is not None:
                raise mistake from None                                     # (raised in its own process)
            e.budget -= getattr(f, "finished", time.monotonic()) - getattr(f, "started", time.monotonic())
            why = _failure(what, ex)
    else:
        why = f"{what}: {blocked}" if (blocked := caller.blocked(f)) else f"{what} {STALLED}"
        f.cancel()                                             # (still waiting for a slot: never made)
        caller.give_up(f)                                      # (hung in a thread: its slot no longer held)
        e.abandoned, e.hung = True, f                          # (before e.env is read: Episode.opened)
        if e.env is not None:                                  # (in a process of its own: ended now)
            e.env.kill()
    if fails:
        e.fail(why)
    return None


STALLED = "did not return within env.timeout_seconds"     # an episode's environment stalled (or its server did)


class EnvironmentsStalled(RuntimeError):
    """Every episode of a stage failed because its environment did not answer in time: the environment (its server)
    stalls, an infrastructure fault, retried as a preemption is (flows/training.py restarts the server first); not
    the user's mistake, which an environment's own exception is."""


def require_some_episode(cfg: Config, records: list[Rollout], what: str) -> None:
    """Stop a stage whose every episode failed (nothing to train on, or to evaluate): with one line naming the
    first failure when the environment's (or agent's) own code raised (exit 2); EnvironmentsStalled when every
    failure was a timeout (retried)."""
    failed = [r.env_error for r in records if not r.part and r.env_error is not None]
    if not records or not failed or len(failed) != sum(not r.part for r in records):
        return
    if all(STALLED in f for f in failed):
        raise EnvironmentsStalled(f"every episode of {what} timed out ({len(failed)} of {len(failed)}): "
                                  f"the environment does not answer within env.timeout_seconds "
                                  f"({cfg.env.timeout_seconds:g} s); the first: {failed[0][:300]}")
    source = "env.agent" if cfg.env.agent else "env.factory"
    raise UserError(f"{source}: every episode of {what} failed ({len(failed)} of {len(failed)}), nothing to "
                    f"{'evaluate' if what.startswith('the evaluation') else 'train on'}; the first: "
                    f"{' '.join(failed[0].split())[:300]}")


class NotMade(RuntimeError):
    """An episode's environment could not be made (its factory raised, or its process died making it)."""


def _failure(what: str, ex: Exception) -> str:
    if isinstance(ex, NotMade):
        return str(ex)
    if isinstance(ex, EnvironmentFailed):            # raised in the environment's process: "Type: text"
        return f"{what} raised {ex}"
    if isinstance(ex, EnvironmentDied | InvalidReply):
        return f"{what}: {ex}"
    return f"{what} raised {why(ex)}"


# ------------------------------------------------------------------------------------------ episodes

def environments(cfg: Config, services: Services | None = None) -> Callable[[dict], EnvironmentHandle]:
    """What opens each episode's environment (a row -> its handle): on the environment server (env.where a URL,
    env.where), else as env.isolation says (isolation.py: start_environment). What each needs is checked or
    started before any episode: the factory's preflight, the server's address, the forkserver."""
    if placement_of(cfg).env_remote():
        server = server_of(cfg, services)     # no server given: one line, before any episode
        return lambda row, opened=None: RemoteEnvironment.start(cfg, row, server)
    # (imported here too: a process environment's forkserver imports it; a server's environments, only there)
    make = factory_of(cfg)
    if cfg.env.isolation == "process":
        warm_up(cfg)
    return lambda row, opened=None: start_environment(cfg, make, row, opened)


def run_episodes(cfg: Config, table: dict[int, dict], rows: list[int], session: SamplingSession,
                 params: SamplingParams, services: Services | None = None) -> tuple[list[Rollout], Sampled]:
    """params.n episodes of each row of `rows` (`table`: the rows by index), every turn sampled from `session`
    (each record says which server of a pool ran it: sources.py's metrics count them)."""
    ec = cfg.env
    tokenizer = session.tokenizer
    render = Renderer(tokenizer, cfg.generate.max_prompt_length)
    episodes = [Episode(group=g, row=r, data=dict(table[r]), budget=ec.timeout_seconds)
                for g, r in enumerate(rows) for _ in range(params.n)]
    caller = Caller(ec.concurrency)
    load_seconds = sampling_seconds = 0.0
    try:
        begin(caller, episodes, environments(cfg, services), render)
        for turn in range(ec.max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            budgets = [turn_budget(cfg, e, params.max_new_tokens) for e in active]
            sampled = session.sample([e.prompt_ids + e.ids for e in active], SamplingParams(
                n=1, max_new_tokens=max(budgets), temperature=params.temperature, top_p=params.top_p,
                top_k=params.top_k, seed=params.seed + turn * TURN_SEED),
                keys=[f"{params.seed}/{id(e)}" for e in active])
            load_seconds += sampled.load_seconds
            sampling_seconds += sampled.sampling_seconds
            for e, s, budget in zip(active, sampled.samples, budgets):
                model_turn(cfg, e, s.completion_ids[:budget], s.logprobs[:budget], tokenizer, sampled.sampling_seconds)
            ended = [not s.truncated and len(s.completion_ids) <= budget          # by a stop id, not the budget
                     for s, budget in zip(sampled.samples, budgets)]
            step(cfg, caller, active, ended, render)
    finally:
        close(caller, episodes)
    return [record(cfg, e, tokenizer) for e in episodes], Sampled([], load_seconds, sampling_seconds)


# One episode's steps, shared by the stage's turns in lockstep (run_episodes) and the streaming sampler
# (tasks/envs/runtime/streamed.py), which takes each episode's next turn as soon as its last one is stepped.

def begin(caller: Caller, episodes: list[Episode], open_environment: Callable[..., EnvironmentHandle],
          render: Renderer) -> None:
    """Open each episode's environment and render its first prompt from reset's messages, all at once; a failed
    reset leaves the episode failed with a one-token placeholder prompt (no completion, no reward)."""
    def reset(e: Episode) -> list[dict]:
        try:
            e.env = open_environment(e.data, e.opened)  # (told of its process before it is made: killable)
        except (ServerGone, ServerRefused, UserError):
            raise
        except Exception as ex:  # noqa: BLE001 - the factory's own failure: said as its, not reset's
            raise NotMade(_failure("the environment's factory", ex)) from None
        if e.abandoned:          # (an environment on the server: made after its call was given up, ended now)
            e.env.kill()
            raise NotMade("the environment was opened after its call was given up")
        e.schemas = e.env.tool_schemas
        return e.env.reset(e.data)

    for e, messages in zip(episodes, _each(caller, episodes, "reset", reset)):
        if e.error is None:
            try:
                e.prompt = as_messages(messages, "reset's messages")
                e.prompt_ids = render.prompt(e.prompt, e.schemas)
            except (TypeError, ValueError) as ex:
                e.fail(f"reset: {ex}")
        if not e.prompt_ids:
            e.prompt_ids = [render.tok.eos_token_id]


def turn_budget(cfg: Config, e: Episode, max_new_tokens: int) -> int:
    """The tokens episode e's next model turn may take: generate.max_completion_length, within env.max_tokens."""
    return min(max_new_tokens, cfg.env.max_tokens - len(e.ids))


def model_turn(cfg: Config, e: Episode, ids: list[int], logprobs: list[float], tokenizer, seconds: float,
               versions: list[int] | None = None) -> None:
    """Episode e's model turn (`ids` within its budget) appended, with its assistant message (tool calls parsed
    where the environment declares tools)."""
    e.ids += ids
    e.mask += [1] * len(ids)
    e.logprobs += logprobs
    e.versions += versions or []
    e.model_turns += 1
    e.timings.append({"model": round(seconds, 6)})
    text = tokenizer.decode(ids, skip_special_tokens=True)
    content, calls = parse_tool_calls(text) if e.schemas else (text, [])
    e.turns.append({"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})})
    if len(e.ids) >= cfg.env.max_tokens:
        e.truncated = True


TOKEN_CHARS = 256      # characters one token holds at most (an observation past room x this cannot fit in it)


def _cut(message: dict, chars: int) -> dict:
    """`message` with its text cut to `chars` characters (what an episode keeps of an observation too long)."""
    content = message.get("content")
    if isinstance(content, str) and len(content) > chars:
        return {**message, "content": content[:chars]}
    if isinstance(content, list):
        return {**message, "content": [{**p, "text": str(p["text"])[:chars]} if isinstance(p, dict) and
                                       isinstance(p.get("text"), str) else p for p in content]}
    return message


def step(cfg: Config, caller: Caller, active: list[Episode], ended: list[bool], render: Renderer) -> None:
    """Each episode of `active`, its model turn just taken, steps its environment (all at once): its reward kept,
    and its observation appended as the tokens the template renders (mask 0), or the episode is done (the
    environment said so, no observation, env.max_turns or env.max_tokens reached) or failed."""
    steps = _each(caller, active, "step", lambda e: _timed(e, e.env.step, e.turns[-1]))
    for e, raw, end in zip(active, steps, ended):
        if e.error is not None:
            continue
        try:
            st = as_step(raw)
        except TypeError as ex:
            e.fail(f"step: {ex}")
            continue
        e.rewards.append(st.reward)
        room = max(0, cfg.env.max_tokens - len(e.ids)) * TOKEN_CHARS
        # more tokens than there is room for, whatever they are: not rendered (50 MB took minutes)
        if sum(len(message_text(m.get("content"))) for m in st.observation) > room:
            e.turns += [_cut(m, room) for m in st.observation]
            e.truncated = e.done = True
            continue
        e.turns += st.observation
        if st.done or e.truncated or e.model_turns >= cfg.env.max_turns or not st.observation:
            e.done = True
            continue
        try:
            # (the closing loses its EOS only where the turn wrote the tokenizer's: a turn ended by another stop
            # id of the model's, Qwen's <|endoftext|>, gets the template's closing in full)
            obs = render.observation(st.observation, e.schemas, end and e.ids[-1:] == [render.tok.eos_token_id])
        except (TypeError, ValueError) as ex:
            e.fail(f"step's observation: {ex}")
            continue
        if len(e.ids) + len(obs) >= cfg.env.max_tokens:      # no room left for another model turn
            e.truncated = e.done = True
            continue
        e.ids += obs
        e.mask += [0] * len(obs)
        e.logprobs += [0.0] * len(obs)
        e.versions += e.versions[-1:] * len(obs)              # (streamed: the observation's, its turn's version)


def pool_metrics(server: tuple[str, str], records: list[Rollout]) -> dict[str, float]:
    """env/pool_*: these episodes per server of the pool (Rollout.env_server), those failed because their server
    was lost, and the pool's own counts now (/health: live servers, servers replaced so far). Nothing when the
    server is not a pool. (The generate stage's episodes, or an iteration's streamed groups.)"""
    from tasks.envs.runtime.pool import LOST

    served = [r.env_server for r in records if r.env_server is not None and not r.part]
    if not served:
        return {}
    out: dict[str, float] = {"env/pool_lost": float(sum(LOST in (r.env_error or "") for r in records))}
    try:
        import httpx

        health = httpx.get(f"{server[0]}/health", timeout=5.0).json()
        out |= {"env/pool_live": float(health["live"]), "env/pool_replaced": float(health["replaced"])}
        size = int(health["size"])
    except Exception:  # noqa: BLE001 - the counts from the episodes' ids still say where they went
        size = 1 + max(int(i) for i in served)
    for i in range(size):
        out[f"env/pool_server{i}_episodes"] = float(served.count(str(i)))
    return out


def _timed(e: Episode, call, *args):
    """call(*args), its seconds kept as the episode's last turn's environment time."""
    t0 = time.perf_counter()
    try:
        return call(*args)
    finally:
        e.timings[-1]["env"] = round(time.perf_counter() - t0, 6)


def close(caller: Caller, episodes: list[Episode], stop: bool = True) -> None:
    """Keep each environment's state (env_state), then close it (one whose episode failed is killed instead
    where it can be: it may be hung or gone); `stop`: the caller's threads too (its last use). An environment in
    the stage's process whose call past its time still runs is left alone: closed beside that call, one that is
    not thread-safe (a driver, a C extension) broke, or took the stage down."""
    opened = [e for e in episodes if e.env is not None and not (
        isinstance(e.env, ThreadEnvironment) and e.hung is not None and not e.hung.done())]
    for e in opened:
        e.budget = max(e.budget, 0.0) + 5.0
    _each(caller, opened, "close", lambda e: e.env.close(failed=e.error is not None), fails=False)
    for e in opened:
        e.state = e.env.state
    if stop:
        caller.stop()


def record(cfg: Config, e: Episode, tokenizer) -> Rollout:
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
                   env_state=e.state, timings=e.timings, versions=e.versions or None, env_server=_pool_member(e))


def _pool_member(e: Episode) -> str | None:
    """The index of the pool's server that ran episode e (from its pool episode id); None off a pool."""
    from tasks.envs.runtime.pool import parse_episode_key

    parts = parse_episode_key(getattr(e.env, "key", None))
    return None if parts is None else str(parts[0])


def episode_metrics(records: list[Rollout]) -> dict[str, float]:
    """env/*: turns, returns, failures and the model's share of the tokens (per episode: an agent's step-wise
    parts after its first sample are not counted again)."""
    records = [r for r in records if not r.part]
    n = max(len(records), 1)
    returns = [r.env_return for r in records if r.env_return is not None]
    return {"env/episodes": float(len(records)),
            "env/turns_mean": sum(sum(m.get("role") == "assistant" for m in r.turns or []) for r in records) / n,
            "env/return_mean": sum(returns) / max(len(returns), 1),
            "env/errors": float(sum(r.env_error is not None for r in records)),
            "env/truncated": float(sum(r.truncated for r in records)),
            "env/model_tokens_mean": sum(sum(r.mask or []) for r in records) / n}

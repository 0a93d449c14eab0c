"""Episodes in the streaming sampler (generate.streaming with env.factory or env.agent): each model turn of an
episode is a row of the sampler's continuous batch (tasks/engines/streaming.py), so a long episode holds no
other back and a group is committed the moment its last episode ends.

    Stream.of(cfg, first, listener, groups=StreamedEpisodes.given(services))    # env.factory
    Stream.of(cfg, first, listener, groups=StreamedAgents.given(services))      # env.agent

Environments: an episode's next turn joins as soon as its environment has stepped on the last one (episodes.py's
steps, run in the sampler's thread between two decode steps: it decodes nothing meanwhile). Agents: each call an
agent makes to its endpoint joins the batch as it comes and is answered when its row finishes; the agents run
meanwhile (agents.py's runners). Each model token records the policy version that drew it: a later turn, or the
rest of a turn after an interruption, may be a newer policy's; tokens between turns (observations, a call's
prompt beyond the last reply) carry the version of the turn before them (mask 0: never trained on).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.contracts import Rollout, Sample, Sampled, SamplingParams
from tasks.engines.streaming import GroupSource, Row
from tasks.envs.runtime.agents import EPISODE_SEED, Processes, Running, Threads, agent_of, ended, episode_records
from tasks.envs.runtime.calls import Refused
from tasks.envs.runtime.endpoint import Endpoint
from tasks.envs.runtime.episodes import Episode, begin, close, environments, model_turn, record, step, turn_budget
from tasks.envs.runtime.isolation import Caller
from tasks.envs.runtime.rendering import Renderer

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.placement import Services


class StreamedEpisodes(GroupSource):
    """The streaming sampler's group source for env.factory: a group is `n` episodes of its dataset row (a GRPO
    group), complete when each has ended (or failed); its records are the stage's episode records."""

    def __init__(self, cfg: Config, tokenizer, n: int, services: Services | None = None):
        self.cfg, self.tokenizer, self.n = cfg, tokenizer, n
        self.render = Renderer(tokenizer, cfg.generate.max_prompt_length)
        self.caller = Caller(cfg.env.concurrency)
        self.open_environment = environments(cfg, services)    # (the factory checked, the server found: once)
        self.groups: dict[tuple, list[Episode]] = {}

    @classmethod
    def given(cls, services: Services | None):
        """The source's factory, for Stream.of(groups=...): episodes against the environments `services` names."""
        return lambda cfg, tokenizer, n: cls(cfg, tokenizer, n, services)

    def start(self, key: tuple, row: int, columns: dict) -> list[Row]:
        """Group `key`'s episodes opened (reset, their prompts rendered): the rows of their first turns."""
        episodes = [Episode(group=key[1], row=row, data=dict(columns), budget=self.cfg.env.timeout_seconds)
                    for _ in range(self.n)]
        self.groups[key] = episodes            # (first: where begin raises, close() still ends those it opened)
        begin(self.caller, episodes, self.open_environment, self.render)
        return [r for e in episodes if not e.done and (r := self._turn(key, e)) is not None]

    def advance(self, finished: list[Row]) -> list[Row]:
        """The finished turns taken by their episodes and stepped (at once); the next turns of those going on."""
        if not finished:
            return []
        episodes = [r.owner for r in finished]
        for r in finished:
            model_turn(self.cfg, r.owner, r.tokens, r.logprobs, self.tokenizer, r.seconds, r.versions)
        step(self.cfg, self.caller, episodes, [not r.truncated for r in finished], self.render)   # (ended by EOS)
        return [t for r, e in zip(finished, episodes) if not e.done and (t := self._turn(r.group, e)) is not None]

    def _turn(self, key: tuple, e: Episode) -> Row | None:
        """Episode e's next turn as a row: its whole context so far as the prompt, its own token budget (none left
        within env.max_tokens: the episode ends, truncated)."""
        budget = turn_budget(self.cfg, e, self.cfg.generate.max_completion_length)
        if budget <= 0:
            e.truncated = e.done = True
            return None
        return Row(key, e.prompt_ids + e.ids, limit=budget, owner=e)

    def complete(self) -> list[tuple]:
        return [k for k, episodes in self.groups.items() if all(e.done for e in episodes)]

    def records(self, key: tuple) -> tuple[int, list[Rollout]]:
        """A complete group's dataset row and records, its environments closed (their state kept)."""
        episodes = self.groups.pop(key)
        close(self.caller, episodes, stop=False)
        return episodes[0].row, [record(self.cfg, e, self.tokenizer) for e in episodes]

    def in_flight(self, rows: list[Row]) -> int:
        """The model tokens of the episodes not complete: their turns taken, and `rows` (their turns in flight)."""
        return sum(sum(e.mask) for episodes in self.groups.values() for e in episodes) + \
            sum(len(r.tokens) for r in rows)

    def close(self) -> None:
        """The environments of the groups in flight closed (a stopped sampler), and the caller's threads ended."""
        close(self.caller, [e for episodes in self.groups.values() for e in episodes])
        self.groups.clear()


class _Calls:
    """The agents' endpoint's session while streaming: each call (one prompt) becomes a row, queued for the
    sampler's batch; the call returns when its row has finished (or its episode was ended: an error)."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.tokenizer, self.params, self.load_seconds = tokenizer, params, 0.0
        self.lock = threading.Lock()
        self.queue: list[Row] = []
        self.calls: dict[str, tuple[Row, threading.Event]] = {}    # episode key -> its call in flight
        self.closed = False
        self.ended: set[str] = set()        # episodes whose agents were ended: a call of theirs still coming is refused
        self.discarded = 0                  # tokens of rows whose calls had ended before they finished

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams, keys: list[str] | None = None) -> Sampled:
        # (the endpoint checked them against env.endpoint's bounds; a row samples at its call's own)
        own = {k: v for k, v in (("temperature", params.temperature), ("top_p", params.top_p))
               if v != getattr(self.params, k)}
        (ids,), (key,) = prompt_ids, keys          # (key: the episode's, Endpoint.route_key)
        row, done = Row(None, list(ids), limit=params.max_new_tokens, owner=key, sampling=own or None), \
            threading.Event()
        with self.lock:
            if self.closed or key in self.ended:
                raise Refused(409, "episode_closed", "the episode has ended")
            self.calls[key] = (row, done)
            self.queue.append(row)
        done.wait()
        with self.lock:
            self.calls.pop(key, None)
        if not row.done:
            raise Refused(409, "episode_closed", "the episode has ended")
        return Sampled([Sample(0, row.tokens, row.logprobs, row.truncated, row.versions)], 0.0, row.seconds)

    def arrived(self) -> list[Row]:
        with self.lock:
            rows, self.queue = self.queue, []
        return rows

    def answer(self, row: Row) -> None:
        """A finished row's call answered; a row whose call has ended meanwhile (its agent ended mid-call: a
        client-side timeout) was decoded for nothing: its tokens are counted as discarded."""
        with self.lock:
            call = self.calls.get(row.owner)
            if call is None or call[0] is not row:
                self.discarded += len(row.tokens)
        if call is not None and call[0] is row:
            call[1].set()

    def cancel(self, key: str) -> None:
        """Episode `key`'s call in flight answered with an error (its agent was ended); its row, if it has joined
        the batch, finishes unread."""
        with self.lock:
            self.ended.add(key)
            call = self.calls.get(key)
            if call is not None and call[0] in self.queue:
                self.queue.remove(call[0])
        if call is not None:
            call[1].set()

    def close(self) -> None:
        """Every call in flight answered with an error, and any call after (an agent still sending as it ended)."""
        with self.lock:
            self.closed, self.queue = True, []
            waiting = [done for _, done in self.calls.values()]
        for done in waiting:
            done.set()


class StreamedAgents(GroupSource):
    """The streaming sampler's group source for env.agent: a group is `n` episodes of its dataset row, each an
    agent run against the endpoint (env.concurrency agents at a time, the rest waiting for a slot), complete
    when each agent has returned, failed or run out of env.timeout_seconds; its records are the stage's."""

    def __init__(self, cfg: Config, tokenizer, n: int, services: Services | None = None):
        self.cfg, self.tokenizer, self.n = cfg, tokenizer, n
        gc = cfg.generate
        self.session = _Calls(tokenizer, SamplingParams(n=1, max_new_tokens=gc.max_completion_length,
                                                        temperature=gc.temperature, top_p=gc.top_p, seed=0,
                                                        top_k=gc.top_k))
        self.endpoint = Endpoint(cfg, self.session, layout.latest(cfg.run.name, "policy"), self.session.params)
        self.endpoint.start()
        self.runner = Processes(cfg) if cfg.env.isolation == "process" else Threads(
            agent_of(cfg), dict(cfg.env.kwargs), cfg.env.timeout_seconds)
        self.groups: dict[tuple, dict] = {}     # key -> {"row", "data", "results": {episode: outcome}, "logs"}
        self.waiting: list[tuple[tuple, int]] = []      # (group, episode) not started: no slot yet
        self.running: dict[int, tuple[tuple, Running]] = {}
        self.count = 0

    @classmethod
    def given(cls, services: Services | None):
        return lambda cfg, tokenizer, n: cls(cfg, tokenizer, n, services)

    def start(self, key: tuple, row: int, columns: dict) -> list[Row]:
        """Group `key`'s agents started (as slots allow); their calls join the batch as they make them."""
        self.groups[key] = {"row": row, "data": dict(columns), "results": {}, "logs": {}}
        for _ in range(self.n):
            self.waiting.append((key, self.count))
            self.count += 1
        self._fill()
        return []

    def _fill(self) -> None:
        while self.waiting and len(self.running) < max(self.cfg.env.concurrency, 1):
            key, i = self.waiting.pop(0)
            seed = (self.cfg.run.seed + i * EPISODE_SEED) % (2 ** 63)
            run = Running(i, self.endpoint.open(i, seed), time.monotonic())
            self.runner.start(run, dict(self.groups[key]["data"]), self.endpoint.base_url)
            self.running[i] = (key, run)

    def arrived(self) -> list[Row]:
        return self.session.arrived()

    def queued(self) -> int:
        return len(self.session.queue)

    def occupied(self, rows: list[Row]) -> int:
        """Every episode started or waiting for a slot holds its place: its call is in the batch or will be."""
        return len(self.running) + len(self.waiting)

    def advance(self, finished: list[Row]) -> list[Row]:
        """Each finished call answered: its agent goes on, and its next call arrives on its own."""
        for r in finished:
            self.session.answer(r)
        return []

    def complete(self) -> list[tuple]:
        """The groups whose every agent has ended (the ended ones' episodes closed, their slots refilled)."""
        for i, (key, run) in list(self.running.items()):
            log = self.endpoint.episodes[run.key]
            result = ended(run, log, self.cfg.env.timeout_seconds)
            if result is None:
                continue
            self.session.cancel(self.endpoint.route_key(i))     # (killed mid-call: the call returns, the log is free)
            g = self.groups[key]
            g["results"][i], g["logs"][i] = result, self.endpoint.close(run.key)
            del self.running[i]
        self._fill()
        return [k for k, g in self.groups.items() if len(g["results"]) == self.n]

    def records(self, key: tuple) -> tuple[int, list[Rollout]]:
        g = self.groups.pop(key)
        out = []
        for i in sorted(g["results"]):
            out += episode_records(self.cfg, g["logs"][i], g["results"][i], key[1], g["row"], g["data"],
                                   self.tokenizer)
        return g["row"], out

    def discarded(self) -> int:
        """Tokens decoded for calls that had ended by then, since the last time asked."""
        n, self.session.discarded = self.session.discarded, 0
        return n

    def in_flight(self, rows: list[Row]) -> int:
        """The model tokens of the groups not complete: their episodes' calls so far, and `rows`."""
        logs = [log for g in self.groups.values() for log in g["logs"].values()]
        logs += [self.endpoint.episodes[run.key] for _, run in self.running.values()
                 if run.key in self.endpoint.episodes]
        return sum(len(c.completion_ids) for log in logs for c in log.calls) + sum(len(r.tokens) for r in rows)

    def close(self) -> None:
        """Every agent still at work ended, its call answered with an error, the endpoint stopped."""
        for _, run in self.running.values():
            run.kill()
        self.session.close()
        self.running.clear()
        self.waiting.clear()
        self.runner.stop()
        self.endpoint.stop()
        self.groups.clear()

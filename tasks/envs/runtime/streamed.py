"""Multi-turn episodes in the streaming sampler (generate.streaming with env.factory): each turn of an episode is a
row of the sampler's continuous batch (tasks/engines/streaming.py), and its next turn joins the batch as soon as
the episode's environment has stepped on it, so a long episode holds no other back and a group is committed the
moment its last episode ends.

    Stream.of(cfg, first, listener, groups=StreamedEpisodes.given(services))

The steps are episodes.py's (begin, model_turn, step, close, record), the ones the stage's lockstep turns take;
only their timing differs. Each model token records the policy version that drew it: a later turn, or the rest
of a turn after an interruption, may be a newer policy's; an observation's tokens carry their turn's version
(mask 0: never trained on). The environments' resets and steps run in the sampler's thread between two decode
steps (those of one decode step at once, env.concurrency at a time): the sampler decodes nothing meanwhile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.core.contracts import Rollout
from tasks.engines.streaming import Row
from tasks.envs.runtime.episodes import Episode, begin, close, environments, model_turn, record, step, turn_budget
from tasks.envs.runtime.isolation import Caller
from tasks.envs.runtime.rendering import Renderer

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.placement import Services


class StreamedEpisodes:
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
        begin(self.caller, episodes, self.open_environment, self.render)
        self.groups[key] = episodes
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

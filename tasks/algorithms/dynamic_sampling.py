"""Dynamic sampling (DAPO): which scored groups an iteration trains on (`generate.dynamic_sampling`).

A group (one prompt's `num_generations` completions) whose rewards are all equal has advantage 0 under every
GRPO-family estimator: it teaches nothing, and under a token-mean loss it dilutes the groups that do. Such
groups are dropped and more prompts sampled, in rounds, until the batch holds `prompts_per_iteration` groups
that are not constant, or `max_rounds` rounds were sampled. Pure functions over scored records; the reward stage
(tasks/reward.py) calls `select` after each round, the flow (flows/schedule.py) runs rounds until it says done.

Constant, numerically safe: a group is constant when max - min of its present rewards is at most
`tolerance * max(1, max |reward| of the group)`; a group with fewer than two present rewards is constant too
(it has no baseline). `std != 0` is not the test: rewards that differ by float noise (1e-9) pass it, and their
"advantages" are that noise divided by ~1e-4 (NeMo-RL's finding).
Order: round by round, and within a round by group index; the first `wanted` groups that are not constant are
kept, renumbered 0.. in that order; none found: the first round as it is (said by dynamic/short). Under
generate.streaming the rounds are one stream of groups; `as_rounds` cuts it into the stage mode's rounds.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.core.contracts import Rollout

TOLERANCE = 1e-6              # generate.dynamic_sampling.tolerance's default: what the group metrics use without it


def groups_of(records: list[Rollout]) -> dict[int, list[Rollout]]:
    """The records of each group, in order (an agent's step-wise samples stay with their episode's group)."""
    out: dict[int, list[Rollout]] = defaultdict(list)
    for r in records:
        out[r.group].append(r)
    return dict(sorted(out.items()))


def constant(rewards: list[float | None], scale: float, tolerance: float) -> bool:
    """Whether a group's rewards are all equal within `tolerance * scale` (None, a missing reward, is left out)."""
    present = [x for x in rewards if x is not None]
    return len(present) < 2 or max(present) - min(present) <= tolerance * scale


def scale_of(records: list[Rollout]) -> float:
    """The reward scale a group's constancy test is relative to: max(1, the largest |reward| in it)."""
    return max([1.0, *(abs(r.reward) for r in records if r.reward is not None)])


def constant_groups(records: list[Rollout], tolerance: float) -> dict[int, bool]:
    """Per group: constant or not, each relative to its own scale, so a group's verdict is known as soon as it is
    scored (episodes counted once: an agent's step-wise samples after the first, Rollout.part > 0, share their
    episode's reward)."""
    return {g: constant([r.reward for r in rows if not r.part], scale_of(rows), tolerance)
            for g, rows in groups_of(records).items()}


def select(rounds: list[list[Rollout]], wanted: int, tolerance: float) -> tuple[list[Rollout], dict[str, float]]:
    """The records to train on, from the scored rounds sampled so far, and the dynamic/* metrics."""
    kept: list[Rollout] = []
    sampled = dropped = useful = 0
    for records in rounds:
        flags = constant_groups(records, tolerance)
        for g, rows in groups_of(records).items():
            sampled += 1
            if flags[g]:
                dropped += 1
            elif useful < wanted:
                kept.extend(dataclasses.replace(r, group=useful) for r in rows)
                useful += 1
    if not kept and rounds:
        kept = list(rounds[0])                      # nothing useful anywhere: the first round, without signal
    metrics = {"dynamic/rounds": float(len(rounds)), "dynamic/groups_sampled": float(sampled),
               "dynamic/groups_dropped": float(dropped), "dynamic/groups_kept": float(useful),
               "dynamic/extra_completions": float(sum(len(r) for r in rounds[1:])),
               "dynamic/short": float(max(wanted - useful, 0))}
    return kept, metrics


def enough(rounds: list[list[Rollout]], wanted: int, tolerance: float) -> bool:
    """Whether the rounds so far hold `wanted` groups that are not constant."""
    return sum(not c for records in rounds for c in constant_groups(records, tolerance).values()) >= wanted


def as_rounds(records: list[Rollout], first: int, per_round: int) -> list[list[Rollout]]:
    """A streamed iteration's groups (0..first-1 its prompts, then the extra groups in the order they started)
    cut into the stage mode's rounds: the first `first` groups, then `per_round` groups a round."""
    rounds: dict[int, list[Rollout]] = defaultdict(list)
    for r in records:
        rounds[0 if r.group < first else 1 + (r.group - first) // per_round].append(r)
    return [rounds[k] for k in sorted(rounds)]

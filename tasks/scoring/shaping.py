"""Reward shaping the config adds to the task's rewards: DAPO's soft overlong punishment (`reward.overlong`).

A completion of L tokens, limit L_max and buffer B (DAPO, eq. 13, with the penalty as a factor):
    0                                   L <= L_max - B
    -penalty * (L - (L_max - B)) / B    L_max - B < L <= L_max          (-penalty at the limit)
Unlike train.mask_truncated_completions (which drops a cut-off completion from the loss), a long answer that
still ends is punished a little, one that reaches the limit fully: a gradient away from length itself. It is
added to the reward the advantages are made of, and logged apart (reward/overlong/*); a completion whose task
reward is missing gets none. Evaluation does not add it: the held-out scores are the task's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Rollout

NAME = "overlong"


def overlong(length: int, limit: int, buffer: int, penalty: float) -> float:
    """The punishment of one completion of `length` tokens (<= 0)."""
    start = limit - buffer
    return -penalty * min(max(length - start, 0), buffer) / buffer


def add_overlong(cfg: Config, records: list[Rollout]) -> dict[str, float]:
    """Add reward.overlong's punishment to each scored record (rewards["overlong"], and the combined reward);
    returns reward/overlong/* metrics. An episode counts every token after its first prompt (env.max_tokens, as
    the endpoint counts them): an agent's episode split into samples (Rollout.part) is punished once, by its
    whole length, each of its samples carrying that punishment."""
    ol = cfg.reward.overlong
    if ol is None:
        return {}
    limit = cfg.completion_limit()
    for r, length in zip(records, _episode_lengths(records)):
        if r.reward is not None:
            r.rewards[NAME] = overlong(length, limit, ol.buffer, ol.penalty)
            r.reward += r.rewards[NAME]
    return overlong_metrics(records)


def _episode_lengths(records: list[Rollout]) -> list[int]:
    """Per record, the tokens its episode has after its first prompt: a record's samples after the first
    (part > 0) follow it in the list; their prompts hold what came before them."""
    out, k = [], 0
    while k < len(records):
        end = k + 1
        while end < len(records) and records[end].part:
            end += 1
        parts = records[k:end]
        first = len(parts[0].prompt_ids)
        length = max(len(p.prompt_ids) + len(p.completion_ids) for p in parts) - first if len(parts) > 1 \
            else len(parts[0].completion_ids)
        out += [length] * len(parts)
        k = end
    return out


def overlong_metrics(records: list[Rollout]) -> dict[str, float]:
    """reward/overlong/mean (the punishment, mean over the punished-or-not) and /share (of those punished), per
    episode (an agent's samples after its first, part > 0, are not counted again)."""
    punished = [r.rewards[NAME] for r in records if r.rewards.get(NAME) is not None and not r.part]
    if not punished:
        return {}
    n = len(punished)
    return {f"reward/{NAME}/mean": sum(punished) / n, f"reward/{NAME}/share": sum(p < 0 for p in punished) / n}


def task_reward(r: Rollout) -> float | None:
    """The combined reward without the shaping: what reward/mean reports."""
    return None if r.reward is None else r.reward - (r.rewards.get(NAME) or 0.0)

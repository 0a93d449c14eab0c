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
    returns reward/overlong/* metrics. An episode counts every token after its prompt (env.max_tokens)."""
    ol = cfg.reward.overlong
    if ol is None:
        return {}
    limit = cfg.completion_limit()
    for r in records:
        if r.reward is not None:
            r.rewards[NAME] = overlong(len(r.completion_ids), limit, ol.buffer, ol.penalty)
            r.reward += r.rewards[NAME]
    return overlong_metrics(records)


def overlong_metrics(records: list[Rollout]) -> dict[str, float]:
    """reward/overlong/mean (the punishment, mean over the punished-or-not) and /share (of those punished)."""
    punished = [r.rewards[NAME] for r in records if r.rewards.get(NAME) is not None]
    if not punished:
        return {}
    n = len(punished)
    return {f"reward/{NAME}/mean": sum(punished) / n, f"reward/{NAME}/share": sum(p < 0 for p in punished) / n}


def task_reward(r: Rollout) -> float | None:
    """The combined reward without the shaping: what reward/mean reports."""
    return None if r.reward is None else r.reward - (r.rewards.get(NAME) or 0.0)

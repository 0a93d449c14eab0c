"""Rewards for the demo task (configs/data/successor-*.jsonl): answer a letter's successor, three times.

    prompt "c=" -> answer "ddd"
"""

from __future__ import annotations

from tasks.rewards import text_of


def successor_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """Share of the answer's characters the completion gets right, position by position (0..1).

    >>> successor_reward(["ddd", "dxd", "zzz"], answer=["ddd"] * 3)
    [1.0, 0.6666666666666666, 0.0]
    """
    return [sum(a == b for a, b in zip(text_of(c), ans)) / max(len(ans), 1) for c, ans in zip(completions, answer)]


def stops_reward(completions: list[str], answer: list[str], completion_ids: list[list[int]] | None = None,
                 **kwargs) -> list[float]:
    """1.0 when the completion is no longer than the answer (it stopped instead of rambling), else 0.0."""
    return [1.0 if len(text_of(c)) <= len(ans) else 0.0 for c, ans in zip(completions, answer)]

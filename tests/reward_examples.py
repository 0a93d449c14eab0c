"""Reward functions tests name by import path (reward.functions: [{fn: "tests.reward_examples:NAME"}])."""

from __future__ import annotations

from tasks.rewards.demo import successor_reward


def early_letters_constant(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 for every completion of a prompt whose answer starts before 'e' (a constant group, which
    data.curriculum defers), else the demo's successor reward (groups that differ)."""
    return [1.0 if a < "e" else s for a, s in zip(answer, successor_reward(completions, answer))]


def refuses(completions: list[str], **kwargs) -> list[float]:
    """Raises on every batch (a reward function with a bug)."""
    raise ValueError("cannot parse the answer")

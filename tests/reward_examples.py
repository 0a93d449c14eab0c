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


def fails_until_fixed(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """The demo's successor reward with a bug while the file $RLFLOW_TEST_BUG exists (the user's fix removes it);
    each call appends its iteration and batch size to $RLFLOW_TEST_CALLS."""
    import os

    with open(os.environ["RLFLOW_TEST_CALLS"], "a") as f:
        f.write(f"{kwargs['trainer_state'].global_step + 1}:{len(completions)}\n")
    if os.path.exists(os.environ["RLFLOW_TEST_BUG"]):
        raise KeyError("answer")
    return successor_reward(completions, answer)


def nothing_in_iteration_2(completions: list[str], answer: list[str], trainer_state, **kwargs) -> list:
    """The demo's successor reward, but None for every completion of iteration 2 (a grader that scores nothing
    for a while: a judge's network down)."""
    if trainer_state.global_step == 1:
        return [None] * len(completions)
    return successor_reward(completions, answer)


def chatty_in_iteration_1(completions: list[str], answer: list[str], trainer_state, **kwargs) -> list[float]:
    """The demo's successor reward, printing 80,000 characters a call in iteration 1 (a debug print left in)."""
    if trainer_state.global_step == 0:
        print("x" * 80_000)
    return successor_reward(completions, answer)

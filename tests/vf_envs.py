"""Environments written against `verifiers` (its classic API: MultiTurnEnv, ToolEnv, Rubric), the way its docs
write them; driven by rlflow through the verifiers adapter (tests/test_envs.py). Imports verifiers: kept out of
tests/env_classes.py, which every environment process imports."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


class HigherLower(vf.MultiTurnEnv):
    """Guess the row's number: the environment answers higher / lower until the guess is right."""

    async def setup_state(self, state: vf.State) -> vf.State:
        state["guesses"] = 0
        state["solved"] = False
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess = str(messages[-1]["content"]).strip()
        state["guesses"] += 1
        target = int(state["answer"])
        if not guess.lstrip("-").isdigit():
            return [vf.UserMessage(content="a number, please")]
        if int(guess) == target:
            state["solved"] = True
            state["final_env_response"] = [vf.UserMessage(content="correct")]      # ends the rollout here
            return state["final_env_response"]
        return [vf.UserMessage(content="higher" if int(guess) < target else "lower")]


def solved_quickly(state, **kwargs) -> float:
    """1 for a solved game, less for each guess."""
    return (1.0 - 0.1 * state["guesses"]) if state["solved"] else 0.0


def load_higher_lower(max_turns: int = 6) -> vf.Environment:
    dataset = Dataset.from_list([{"question": "Guess.", "answer": str(n)} for n in range(1, 10)])
    return HigherLower(dataset=dataset, rubric=vf.Rubric(funcs=[solved_quickly]), max_turns=max_turns,
                       system_prompt="Guess the number. Answer with the number only.")


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def right_sum(completion, answer, **kwargs) -> float:
    """1 when the last answer names the sum."""
    return 1.0 if str(answer) in str(completion[-1]["content"]) else 0.0


def load_adder() -> vf.Environment:
    dataset = Dataset.from_list([{"question": f"What is {a} + 22?", "answer": str(a + 22)} for a in range(5)])
    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=vf.Rubric(funcs=[right_sum]), max_turns=4,
                      system_prompt="Use the add tool, then give the sum.")

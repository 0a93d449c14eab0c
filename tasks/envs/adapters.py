"""Environments written for other APIs, driven through the protocol (protocol.py) unchanged.

- `trl`: a class written for TRL's `GRPOTrainer(environment_factory=...)`. `reset(**row)` returns None or
  text appended to the prompt's last user message. Its public methods are the tools. The episode goes on
  while the model calls tools, and ends at the first message without a call. `get_reward()`, when defined, is
  the return (TRL adds it as a reward named after the class).
- `gymnasium`: a text `gymnasium.Env`. `reset(seed=row["seed"])` gives the first observation (a string, after
  the dataset prompt when the row has one). `step(the assistant's text)` gives (observation, reward,
  terminated, truncated, info), and the episode ends at terminated or truncated.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from tasks.core import data
from tasks.envs.protocol import Step
from tasks.envs.tools import call_tools

if TYPE_CHECKING:
    from tasks.core.config import Config


def detect(instance: Any) -> str:
    """auto: gymnasium for a gymnasium.Env; rlflow for `reset(row)` (a positional parameter) with a `step`;
    trl otherwise: `reset(**kwargs)`, tools as methods (one of which may well be called `step`)."""
    try:
        import gymnasium

        if isinstance(instance, gymnasium.Env) or isinstance(getattr(instance, "unwrapped", None), gymnasium.Env):
            return "gymnasium"
    except ImportError:
        pass
    try:
        params = inspect.signature(instance.reset).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return "trl"
    takes_row = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return "rlflow" if takes_row and callable(getattr(instance, "step", None)) else "trl"


def _prompt_messages(cfg: Config, row: dict) -> list[dict]:
    prompt = data.prompt_of(cfg, row) if cfg.data.prompt_column in row else []
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def _append_to_last_user(messages: list[dict], text: str) -> list[dict]:
    for m in reversed(messages):
        if m.get("role") == "user":
            m["content"] = f"{m.get('content') or ''}{text}"
            return messages
    return messages + [{"role": "user", "content": text}]


class TRLEnvironment:
    def __init__(self, instance: Any, cfg: Config, row: dict):
        self.env, self.cfg, self.instance = instance, cfg, instance
        self.tools = [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
                      if name not in ("reset", "get_reward") and not name.startswith("_")]

    def reset(self, row: dict) -> list[dict]:
        observation = self.env.reset(**row)
        messages = _prompt_messages(self.cfg, row)
        return _append_to_last_user(messages, observation) if isinstance(observation, str) else messages

    def step(self, message: dict) -> Step:
        calls = message.get("tool_calls") or []
        if calls:
            return Step(call_tools(calls, self.tools), 0.0, False)
        reward = self.env.get_reward() if callable(getattr(self.env, "get_reward", None)) else 0.0
        return Step([], float(reward), True)

    def close(self) -> None:
        if callable(getattr(self.env, "close", None)):
            self.env.close()


class GymnasiumEnvironment:
    tools: list = []

    def __init__(self, instance: Any, cfg: Config, row: dict):
        self.env, self.cfg = instance, cfg
        self.instance = getattr(instance, "unwrapped", instance)      # (the user's class, inside the wrappers)

    def reset(self, row: dict) -> list[dict]:
        seed = row.get("seed")
        observation, _info = self.env.reset(seed=int(seed) if seed is not None else None)
        messages = _prompt_messages(self.cfg, row)
        if messages and messages[-1].get("role") == "user":
            return _append_to_last_user(messages, f"\n{observation}")
        return messages + [{"role": "user", "content": str(observation)}]

    def step(self, message: dict) -> Step:
        observation, reward, terminated, truncated, info = self.env.step(message.get("content") or "")
        done = bool(terminated or truncated)
        return Step([] if done and not observation else [{"role": "user", "content": str(observation)}],
                    float(reward), done, dict(info or {}))

    def close(self) -> None:
        self.env.close()


ADAPTERS = {"trl": TRLEnvironment, "gymnasium": GymnasiumEnvironment}

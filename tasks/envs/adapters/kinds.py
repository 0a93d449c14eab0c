"""Environments written for other APIs, driven through the protocol (tasks/envs/runtime/protocol.py) unchanged.

- `trl`: a class written for TRL's `GRPOTrainer(environment_factory=...)`. `reset(**row)` returns None or
  text appended to the prompt's last user message (after a newline, unless one side has whitespace there). Its
  public methods are the tools. The episode goes on while the model calls tools, and ends at the first message
  without a call. `get_reward()`, when defined, is the return (TRL adds it as a reward named after the class).
- `gymnasium`: a text `gymnasium.Env`. `reset(seed=row["seed"])` gives the first observation (a string, after
  the dataset prompt when the row has one). `step(the assistant's text)` gives (observation, reward,
  terminated, truncated, info), and the episode ends at terminated or truncated.
- `verifiers`: an environment of verifiers' classic API (`vf.MultiTurnEnv`, `vf.ToolEnv`, `vf.SingleTurnEnv`, ...,
  as `load_environment()` returns them). Its own `rollout` runs the episode, with its stop conditions,
  `env_response` and tools, and its rubric scores it (`score_rollout`) at the end: that is the return. Each of
  its model calls is one turn, answered with the model's message (tool calls as verifiers' ToolCalls).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import sys
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from tasks.core import data
from tasks.core.contracts import Step
from tasks.envs.runtime.tools import call_tools

if TYPE_CHECKING:
    from tasks.core.config import Config


def _is_verifiers(instance: Any) -> bool:
    if "verifiers" not in sys.modules:            # (what made it imported verifiers: never imported here for nothing)
        return False
    try:
        from verifiers.legacy.envs.environment import Environment
    except ImportError:
        return False
    return isinstance(instance, Environment)


def shared(instance: Any) -> bool:
    """One instance may serve every episode of a process: a verifiers environment keeps an episode's state in
    the rollout's own `state`, and is made to run many rollouts at once (load_environment may load a dataset)."""
    return _is_verifiers(instance)


def detect(instance: Any) -> str:
    """auto: verifiers for a verifiers Environment; gymnasium for a gymnasium.Env; rlflow for `reset(row)` (a
    positional parameter) with a `step`; trl otherwise: `reset(**kwargs)`, tools as methods (one of which may
    well be called `step`)."""
    if _is_verifiers(instance):
        return "verifiers"
    gymnasium = sys.modules.get("gymnasium")     # (a gymnasium.Env was made by code that imported it: importing it
    if gymnasium is not None:                    #  here would cost each episode's process ~30 ms for nothing)
        if isinstance(instance, gymnasium.Env) or isinstance(getattr(instance, "unwrapped", None), gymnasium.Env):
            return "gymnasium"
    try:
        params = inspect.signature(instance.reset).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return "trl"
    takes_row = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    return "rlflow" if takes_row and callable(getattr(instance, "step", None)) else "trl"


def _prompt_messages(cfg: Config, row: dict) -> list[dict]:
    prompt = data.prompt_of(cfg, row) if cfg.data.prompt_column in row else []
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]


def _append_to_last_user(messages: list[dict], text: str, sep: str = "") -> list[dict]:
    for m in reversed(messages):
        if m.get("role") == "user":
            m["content"] = _joined(m.get("content") or "", text, sep)
            return messages
    return messages + [{"role": "user", "content": text}]


def _joined(content: Any, text: str, sep: str) -> Any:
    """`content` then `text`, with `sep` between them unless either side already has whitespace there (content as
    parts, multimodal: a text part after them, as TRL adds it)."""
    if isinstance(content, list):
        return content + [{"type": "text", "text": text}]
    if content and text and not content[-1].isspace() and not text[0].isspace():
        return f"{content}{sep}{text}"
    return f"{content}{text}"


def tool_names(cls: type) -> list[str]:
    """A TRL environment class's tools: its public methods but reset and get_reward (TRL's rule)."""
    return [name for name, _ in inspect.getmembers(cls, inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class TRLEnvironment:
    def __init__(self, instance: Any, cfg: Config, row: dict):
        self.env, self.cfg, self.instance = instance, cfg, instance
        self.tools = [getattr(instance, name) for name in tool_names(type(instance))]

    def reset(self, row: dict) -> list[dict]:
        """The prompt, and reset's text after its last user message. TRL glues the two (`content + observation`),
        its examples ending their prompts with a newline; a newline is put between them here when neither has
        whitespace there ("...I name." + "Reach 3." reached the model as "...I name.Reach 3.")."""
        observation = self.env.reset(**row)
        messages = _prompt_messages(self.cfg, row)
        return _append_to_last_user(messages, observation, "\n") if isinstance(observation, str) else messages

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


class VerifiersEnvironment:
    """The verifiers environment's `rollout` runs as a task on the episode's event loop; its client hands each
    prompt to this episode (reset's or step's answer) and waits for the model's message (the next step)."""

    tools: list = []

    def __init__(self, instance: Any, cfg: Config, row: dict):
        self.env, self.cfg = instance, cfg
        self.instance = SimpleNamespace()         # env_state: reward, metrics, stop_condition of this rollout
        self.schemas = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                          "parameters": t.parameters}}
                        for t in (instance.tool_defs or [])]
        self._asked: asyncio.Future | None = None      # the next prompt verifiers sends (or the rollout's end)
        self._answer: asyncio.Future | None = None     # the model's message for it
        self._prompt: list = []
        self._rollout: asyncio.Task | None = None

    def _input(self, row: dict) -> dict:
        messages = _prompt_messages(self.cfg, row)
        if not messages or messages[0].get("role") != "system":
            head = [{"role": "system", "content": self.env.system_prompt}] if self.env.system_prompt else []
            messages = head + [dict(m) for m in (self.env.few_shot or [])] + messages
        info = row.get("info") or {}
        out = {"prompt": messages, "example_id": int(row.get("example_id", 0) or 0),
               "info": json.loads(info) if isinstance(info, str) else dict(info)}
        for key in ("answer", "task"):
            if row.get(key) is not None:
                out[key] = row[key] if key == "task" else str(row[key])
        return out

    async def reset(self, row: dict) -> list[dict]:
        loop = asyncio.get_running_loop()
        self._asked = loop.create_future()
        self._rollout = loop.create_task(self._run(self._input(row)))
        prompt = await self._next()
        if prompt is None:
            raise RuntimeError("the verifiers rollout ended before its first model call")
        self._prompt = prompt
        return [_as_dict(m) for m in prompt]

    async def step(self, message: dict) -> Step:
        import verifiers as vf

        calls = []
        for i, call in enumerate(message.get("tool_calls") or []):
            name, args = (call["function"]["name"], json.dumps(call["function"]["arguments"])) \
                if call.get("type") == "function" else ("", str(call.get("error", "unparsed tool call")))
            calls.append(vf.ToolCall(id=f"call_{len(self._prompt)}_{i}", name=name, arguments=args))
        response = vf.Response(id=f"rlflow-{len(self._prompt)}", created=int(time.time()), model="rlflow",
                               message=vf.ResponseMessage(content=message.get("content") or "",
                                                          tool_calls=calls or None,
                                                          finish_reason="tool_calls" if calls else "stop",
                                                          is_truncated=False))
        self._asked = asyncio.get_running_loop().create_future()
        self._answer.set_result(response)
        prompt = await self._next()
        if prompt is None:                                  # the rollout ended: scored by its rubric (_run)
            final = [_as_dict(m) for m in (self._rollout.result().get("final_env_response") or [])]
            return Step(final, float(self.instance.reward or 0.0), True, self.instance.metrics)
        observation, self._prompt = prompt[len(self._prompt) + 1:], prompt
        return Step([_as_dict(m) for m in observation], 0.0, False)

    async def _next(self) -> list | None:
        """The next prompt verifiers asks the model about, or None when its rollout ended (its error raised)."""
        await asyncio.wait({self._asked, self._rollout}, return_when=asyncio.FIRST_COMPLETED)
        if self._asked.done():
            return self._asked.result()
        self._rollout.result()                              # (raises the rollout's failure)
        return None

    async def ask(self, prompt: list) -> Any:
        self._answer = asyncio.get_running_loop().create_future()
        self._asked.set_result(list(prompt))
        return await self._answer

    async def _run(self, row_input: dict) -> Any:
        state = await self.env.rollout(row_input, _client(self), "rlflow", {})
        if state.get("error") is not None:
            raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
        await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        self.instance.reward = state.get("reward")
        self.instance.stop_condition = state.get("stop_condition")
        self.instance.metrics = {k: v for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)}
        return state

    async def close(self) -> None:
        if self._rollout is not None and not self._rollout.done():
            self._rollout.cancel()


def _as_dict(message: Any) -> dict:
    """A verifiers message as a chat message dict (tool calls in the chat templates' form)."""
    m = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if m.get("role") == "text":
        m["role"] = "user"
    if m.get("tool_calls"):
        m["tool_calls"] = [{"type": "function", "id": c["id"],
                            "function": {"name": c["name"], "arguments": _loads(c["arguments"])}}
                           for c in m["tool_calls"]]
    return {k: v for k, v in m.items() if k in ("role", "content", "tool_calls", "tool_call_id", "name")}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _client(adapter: VerifiersEnvironment) -> Any:
    """A verifiers Client whose model is this episode: get_response hands the prompt over and returns the
    model's message (verifiers' own get_response runs around it: its checks and error types)."""
    return _client_class()(adapter)


@functools.cache
def _client_class() -> type:
    import verifiers as vf

    class TurnClient(vf.Client):
        def setup_client(self, config):
            return None

        async def to_native_tool(self, tool):
            return tool

        async def to_native_prompt(self, messages):
            return messages, {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            return await self.client.ask(prompt)

        async def raise_from_native_response(self, response):
            return None

        async def from_native_response(self, response):
            return response

        async def close(self):
            return None

    return TurnClient


ADAPTERS = {"trl": TRLEnvironment, "gymnasium": GymnasiumEnvironment, "verifiers": VerifiersEnvironment}

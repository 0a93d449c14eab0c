"""What the agents' endpoint (tasks/envs/runtime/endpoint.py) reads and records, apart from the server: the
records of an episode's calls (Call, EpisodeLog), the refusal a request gets (Refused), OpenAI chat messages and
tools normalised, and the Responses API's input read as chat messages. No server state: plain data and functions.
More: docs/internals.md (tasks/envs/runtime/calls.py).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any


class Refused(Exception):
    """A request the endpoint will not serve: (HTTP status, OpenAI error code, one line naming the field)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Call:
    """One model call of an episode, as sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]          # the EOS included when the model stopped on its own
    logprobs: list[float]              # the behaviour logprob of each completion token
    truncated: bool                    # hit its max tokens without EOS (or was cut by a stop string)
    messages: list[dict] | None = None     # a chat call's messages (normalised), None for raw completions
    tools: list[dict] | None = None
    reply: dict | None = None          # the assistant message it answered (normalised)
    extends: int | None = None         # the earlier call whose prompt + completion this prompt starts with
    versions: list[int] | None = None  # per completion token, the policy version that drew it (generate.streaming)
    temperature: float | None = None   # what it was sampled at, where the request asked for other than the pass's
    top_p: float | None = None         # own settings (env.endpoint's bounds): the trainer scores its tokens so


@dataclass
class EpisodeLog:
    """What the endpoint recorded of one episode."""

    index: int
    seed: int
    key: str = ""
    calls: list[Call] = field(default_factory=list)
    reward: float | None = None        # what the agent set with /rl/set_reward (the last one)
    info: dict = field(default_factory=dict)
    limited: str | None = None         # why a call was refused for the episode's limits (turns, tokens)
    responses: dict[str, list[dict]] = field(default_factory=dict)   # its responses' conversations, by id
    busy: float = 0.0                  # seconds the episode had a call open at the endpoint (not the agent's time)
    in_call: float | None = None       # since when it has one open (None: none now)
    open_calls: int = 0                # its calls asked and not yet answered (queued or running)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def busy_seconds(self) -> float:
        running = self.in_call
        return self.busy + (time.monotonic() - running if running is not None else 0.0)


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts (chat `text`, Responses `input_text` /
    `output_text`)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            elif isinstance(part, dict):
                raise Refused(400, "invalid_request_error", f"content part of type {part.get('type')!r}: only "
                              "text is served")
        return "".join(out)
    raise Refused(400, "invalid_request_error", "messages[].content: expected a string or a list of text parts")


def _arguments(raw: Any) -> dict:
    if isinstance(raw, dict):
        return raw
    try:
        value = json.loads(raw or "{}")
    except (TypeError, ValueError):
        return {"_raw": str(raw)}
    return value if isinstance(value, dict) else {"_raw": value}


def normalise(messages: Any) -> list[dict]:
    """Chat messages as the chat template and the prefix comparison take them: role, content as text, tool
    calls as {type, function: {name, arguments: dict}} (what HF chat templates render), a tool message's
    call id and name kept."""
    if not isinstance(messages, list) or not messages:
        raise Refused(400, "invalid_request_error", "messages: expected a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Refused(400, "invalid_request_error", f"messages[{i}]: expected an object with a role")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [{"type": "function", "function": {
                "name": c.get("function", {}).get("name", ""),
                "arguments": _arguments(c.get("function", {}).get("arguments"))}} for c in m["tool_calls"]]
        if role == "tool":
            for k in ("tool_call_id", "name"):
                if m.get(k) is not None:
                    msg[k] = m[k]
        out.append(msg)
    return out


def _same(a: dict, b: dict) -> bool:
    """Two messages alike for the prefix comparison (a tool message's call id and a message's name aside:
    clients renumber them)."""
    return all((a.get(k) or None) == (b.get(k) or None) for k in ("role", "content", "tool_calls"))


def function_tools(tools: Any) -> list[dict] | None:
    """Chat Completions' tools ({type: function, function: {...}}) or the Responses API's (flat), as chat
    templates take them."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise Refused(400, "invalid_request_error", "tools: expected a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise Refused(400, "invalid_request_error", f"tools[{i}]: only function tools are served")
        fn = t.get("function", t)
        if not isinstance(fn.get("name"), str):
            raise Refused(400, "invalid_request_error", f"tools[{i}]: a function tool needs a name")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if k in fn}})
    return out


def _extends(log: EpisodeLog, ids: list[int]) -> int | None:
    """The latest call of the episode whose prompt + completion this prompt starts with."""
    for i in range(len(log.calls) - 1, -1, -1):
        c = log.calls[i]
        if ids[:len(c.prompt_ids) + len(c.completion_ids)] == c.prompt_ids + c.completion_ids:
            return i
    return None


def response_messages(body: dict, log: EpisodeLog) -> list[dict]:
    """The Responses API's `instructions`, `previous_response_id` and `input` (a string or items: messages,
    function calls and their outputs) as chat messages. Instructions are the request's own: as the API has it, a
    previous response's are not carried over (its episode keeps its conversation without them: `responses`)."""
    out: list[dict] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": _text(body["instructions"])})
    prev = body.get("previous_response_id")
    if prev:
        earlier = log.responses.get(prev)
        if earlier is None:
            raise Refused(400, "invalid_request_error", f"previous_response_id: {prev!r} is not a response of "
                          "this episode")
        out += earlier
    items = body.get("input")
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise Refused(400, "invalid_request_error", "input: expected a string or a list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Refused(400, "invalid_request_error", f"input[{i}]: expected an object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and not out[-1].get("_closed"):
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output)})
        elif kind == "reasoning":
            continue
        else:
            raise Refused(400, "invalid_request_error", f"input[{i}]: items of type {kind!r} are not served")
    return out

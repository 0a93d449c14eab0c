"""Tools: Python functions the model may call, their schemas, and tool calls parsed from what it wrote.

    def lookup(city: str) -> str:
        '''The weather in a city.

        Args:
            city: the city's name
        '''
    schemas([lookup])                    # JSON schemas from the signature and docstring (transformers', as TRL),
                                         # built once per function in a process
    content, calls = parse_tool_calls(text)   # Hermes/Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    call_tools(calls, [lookup])          # -> tool messages; a malformed call or a tool that raises is a message too

A call the model got wrong (not JSON, an unknown tool, bad arguments, a tool that raises) becomes a tool
message saying so: an observation the model can learn from, never a crash of the episode.
"""

from __future__ import annotations

import copy
import inspect
import json
import re
import sys
from collections.abc import Callable
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
MAX_RESULT_CHARS = 8192          # a tool's result as the model sees it, at most


def tool_schemas(env) -> list[dict]:
    """The schemas of an environment's `tools` attribute (none when it has none), or its `schemas` as they are
    (an adapter whose tools are declared elsewhere: verifiers' tool_defs)."""
    given = getattr(env, "schemas", None)
    if isinstance(given, list):
        return given
    return schemas(list(getattr(env, "tools", None) or []))


def schemas(tools: list[Callable]) -> list[dict]:
    return [schema(t) for t in tools]


_built: dict[tuple[Any, bool], dict] = {}     # a tool's schema by its function, and whether it was a bound method


def schema(tool: Callable) -> dict:
    """One tool's schema, built once per process for its function: every episode's instance of a class has bound
    methods of the same functions, and the schema of a method does not depend on its instance (`self` is not in
    it). With env.isolation: process the forkserver builds them for the environment class's methods before it
    forks the episodes (isolation.py: _prepare_forkserver), so a child finds them built."""
    fn = getattr(tool, "__func__", tool)
    key = (fn, fn is not tool)
    try:
        built = _built.get(key)
    except TypeError:                  # (a callable object that cannot be a key: built each time)
        key, built = None, None
    if built is None:
        from transformers.utils import get_json_schema

        _torch_only_once_imported()
        built = get_json_schema(tool)
        if key is not None:
            _built[key] = built
    return copy.deepcopy(built)        # (a caller's edits never reach the next episode's)


def _torch_only_once_imported() -> None:
    """transformers' schema builder imports torch for every tool's parameters when torch is installed (to map a
    torch.Tensor hint to audio): ~1 s, and ~180 MB in every process that builds a schema, where each episode's
    process forked from the environments' forkserver then paid its fork and exit (~20 ms an episode here). A hint
    can be torch.Tensor only where torch was imported (by the hint's own module), so torch counts as available to
    it only once imported: the same schemas, without the import. Set once per process, kept."""
    try:
        from transformers.utils import chat_template_utils as builder
    except ImportError:                                 # (another layout of transformers: its own way)
        return
    available = builder.is_torch_available
    if getattr(available, "rlflow_imported_only", False):
        return

    def imported_only() -> bool:
        return "torch" in sys.modules and available()

    imported_only.rlflow_imported_only = True       # type: ignore[attr-defined]
    builder.is_torch_available = imported_only


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text without its tool calls, the calls). A call is {"type": "function", "function": {"name",
    "arguments"}}, or {"type": "error", "error": why} for a <tool_call> block that does not parse."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('expected {"name": ..., "arguments": {...}}')
            args = call.get("arguments", call.get("parameters", {}))
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
            calls.append({"type": "function", "function": {"name": call["name"], "arguments": args}})
        except ValueError as e:              # (json.JSONDecodeError is a ValueError)
            calls.append({"type": "error", "error": f"could not parse the tool call: {e}"})
    content = _CALL.sub("", text).strip() if calls else text
    return content, calls


def call_tools(calls: list[dict], tools: list[Callable]) -> list[dict]:
    """Run each call; one tool message per call, in order."""
    by_name = {t.__name__: t for t in tools}
    out = []
    for call in calls:
        if call["type"] != "function":
            out.append({"role": "tool", "name": "error", "content": call.get("error", "unsupported call")})
            continue
        name, args = call["function"]["name"], call["function"]["arguments"]
        tool = by_name.get(name)
        if tool is None:
            result: Any = {"error": f"no tool named {name!r} (tools: {sorted(by_name)})"}
        else:
            try:
                inspect.signature(tool).bind(**args)
                result = tool(**args)
                if inspect.isawaitable(result):
                    import asyncio

                    result = asyncio.run(result)
            except TypeError as e:
                result = {"error": f"bad arguments for {name}: {e}"}
            except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation, as in TRL
                result = {"error": str(e)}
        out.append({"role": "tool", "name": name, "content": str(result)[:MAX_RESULT_CHARS]})    # (TRL: str())
    return out

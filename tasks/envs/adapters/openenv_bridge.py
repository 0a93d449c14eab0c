"""openenv-core's client, run in the OpenEnv environment's own Python (.venv-openenv: openenv-core pins packages
that clash with Prefect's, Makefile) for rlflow's OpenEnv adapter (tasks/envs/adapters/openenv_adapter.py).
Standard library and openenv only: this file is run by path, never imported by rlflow.

    .venv-openenv/bin/python tasks/envs/adapters/openenv_bridge.py    # JSON lines: requests on stdin, replies on stdout

A request is {"id", "op": open | reset | step | close, "session", ...}; each session is one client (one
WebSocket session on the environment's server: one episode). Requests run concurrently on one event loop. A
reply is {"id", "ok": value} or {"id", "error": "Type: text"}.

    .venv-openenv/bin/python tasks/envs/adapters/openenv_bridge.py --probe '{"client": ..., "action": ...}'

(the adapter's preflight): exit 3 without openenv-core, else {"importing": true} as it starts importing the
classes named, then one JSON line, {"client": why | null, "action": why | null, "schema": the action class's
JSON schema | null}: what is wrong with each class named, resolved here (no second line: an import ended it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import threading
from typing import Any

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]          # (run by path: this folder's modules must not shadow the environment's packages)


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _plain(value: Any) -> Any:
    """An observation as JSON-able data: a pydantic model's fields, a dict as it is."""
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return value
    return vars(value) if hasattr(value, "__dict__") else value


def _result(r: Any) -> dict:
    return {"observation": _plain(r.observation), "reward": r.reward, "done": bool(r.done)}


def _class(spec: str | None, methods: tuple[str, ...]) -> tuple[Any, str | None]:
    """The class `spec` ("module:Class") names, or why it names none (of `methods`)."""
    module, _, attr = (spec or "").partition(":") if isinstance(spec, str) else ("", "", "")
    if not module or not attr:
        return None, f"{spec!r} is not module:Class"
    try:
        found = getattr(importlib.import_module(module), attr)
    except AttributeError:
        return None, f"module {module!r} has no {attr!r}"
    except BaseException as e:  # noqa: BLE001 - the user's module: its failure (a sys.exit in it too) is the answer
        text = str(e).splitlines()[0] if str(e) else ""
        return None, f"importing it raised {type(e).__name__}{': ' + text if text else ''}".strip()
    lacks = [m for m in methods if not callable(getattr(found, m, None))]
    if not isinstance(found, type) or lacks:
        what = f"a class without {', '.join(lacks)}" if isinstance(found, type) else f"a {type(found).__name__}"
        return None, f"{spec} is {what}"
    return found, None


def _schema(action: Any) -> dict | None:
    """The action class's fields as JSON schema (a pydantic model's own; a dataclass's names), if it has them."""
    if hasattr(action, "model_json_schema"):
        return action.model_json_schema()
    if dataclasses.is_dataclass(action):
        return {"title": action.__name__, "additionalProperties": False,
                "properties": {f.name: {} for f in dataclasses.fields(action) if f.init}}
    return None


def probe(request: dict) -> dict:
    client = _class(request.get("client"), ("connect", "reset", "step"))[1]
    action, why = _class(request["action"], ()) if request.get("action") else (None, None)
    try:
        schema = _schema(action) if action is not None else None
    except Exception:  # noqa: BLE001 - a schema that cannot be read is not checked
        schema = None
    return {"client": client, "action": why, "schema": schema}


class OpenEnvBridge:
    def __init__(self) -> None:
        self.sessions: dict[str, tuple[Any, Any]] = {}
        self.write = threading.Lock()

    async def handle(self, req: dict) -> Any:
        op, sid = req["op"], req["session"]
        if op == "open":
            client = _load(req["client"])(base_url=req["base_url"], message_timeout_s=req["timeout"])
            await client.connect()
            self.sessions[sid] = (client, _load(req["action"]) if req.get("action") else None)
            return None
        if sid not in self.sessions:
            raise KeyError(f"no session {sid}")
        client, action_cls = self.sessions[sid]
        if op == "reset":
            return _result(await client.reset(**req["kwargs"]))
        if op == "step":
            action = req["action"]
            return _result(await client.step(action_cls(**action) if action_cls else action))
        if op == "close":
            del self.sessions[sid]
            await client.close()
            return None
        raise ValueError(f"unknown op {op!r}")

    async def serve(self, line: str) -> None:
        req: dict = {}
        try:
            req = json.loads(line)
            reply = {"id": req["id"], "ok": await self.handle(req)}
        except Exception as e:  # noqa: BLE001 - the episode's failure, reported to rlflow
            text = str(e).splitlines()[0] if str(e) else ""
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {text}".strip()}
        out = json.dumps(reply, default=str)
        with self.write:
            sys.stdout.write(out + "\n")
            sys.stdout.flush()


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        if importlib.util.find_spec("openenv") is None:
            sys.exit(3)                                     # (the adapter's NO_OPENENV; 1: a module's own exit)
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)                                       # (what the user's modules print: not the answer)
        out.write(json.dumps({"importing": True}) + "\n")
        out.flush()
        out.write(json.dumps(probe(json.loads(sys.argv[2])), default=str) + "\n")
        out.flush()
        return
    bridge = OpenEnvBridge()
    loop = asyncio.new_event_loop()

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(lambda line=line: loop.create_task(bridge.serve(line)))
        loop.call_soon_threadsafe(loop.stop)                 # rlflow closed the pipe: done

    import openenv.core  # noqa: F401 - (fail here, at once, where it is not installed)

    sys.stdout.write(json.dumps({"id": None, "ok": "ready"}) + "\n")
    sys.stdout.flush()
    threading.Thread(target=read, daemon=True).start()
    loop.run_forever()


if __name__ == "__main__":
    main()

"""openenv-core's client, run in the OpenEnv environment's own Python (.venv-openenv: openenv-core pins packages
that clash with Prefect's, Makefile) for rlflow's OpenEnv adapter (tasks/envs/adapters/openenv_adapter.py).
Standard library and openenv only: this file is run by path, never imported by rlflow.

    .venv-openenv/bin/python tasks/envs/adapters/openenv_bridge.py    # JSON lines: requests on stdin, replies on stdout

A request is {"id", "op": open | reset | step | close, "session", ...}; each session is one client (one
WebSocket session on the environment's server: one episode). Requests run concurrently on one event loop. A
reply is {"id", "ok": value} or {"id", "error": "Type: text"}.
"""

from __future__ import annotations

import asyncio
import importlib
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

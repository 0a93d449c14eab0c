"""verifiers 0.4 environments, run in verifiers 0.4's own Python (.venv-verifiers: the main environment pins
verifiers 0.3.1 for the 0.3 adapter, Makefile) for rlflow's verifiers 0.4 agent (tasks/envs/adapters/verifiers_v04.py).
Standard library and verifiers only: this file is run by path, never imported by rlflow.

    .venv-verifiers/bin/python tasks/envs/adapters/verifiers_v04_bridge.py
                                       # JSON lines: requests on stdin, replies on stdout

It does for rlflow what verifiers' own env server does for a trainer (verifiers.v1.serve.server.EnvServer._run),
over JSON lines instead of ZMQ and msgpack.

Requests: {"id", "op": "run", "env": {...}, "task_idx" | "task_data", "model", "client": {...}, "key",
"sampling"}, {"id", "op": "tasks" | "check", "env"}, {"id", "op": "cancel", "target"}. Replies: {"id", "ok": value} or
{"id", "error": "Type: text"}; the first line, {"id": null, "ok": "ready"}, says verifiers imported.
More: docs/internals.md (tasks/envs/adapters/verifiers_v04_bridge.py): what it runs, and why a transport of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import threading
import uuid
from typing import Any

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]          # (run by path: this folder's modules must not shadow the environment's packages)

# The harness programs run with `uv` from PATH; this Python's own (pip-installed beside verifiers) comes first,
# or verifiers would `pip install --user` one into the home directory (verifiers.v1.runtimes.base._ENSURE_UV).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
# uv byte-compiles a script's environment when it prepares it (once; later preparations find it compiled): where
# PYTHONDONTWRITEBYTECODE is set (rlflow's machines: Makefile) nothing else would ever write the .pyc files, and every
# harness program (a Python importing openai, one per rollout and turn) would compile its imports again: ~1 s each.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")


def _plain(value: Any) -> Any:
    """A verifiers record (pydantic) as JSON-able data."""
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value


class Loaded:
    """One environment config: the environment, held inside env.serving() until the bridge ends."""

    def __init__(self, config: dict):
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        self.env = load_environment(resolve_env_config(config))
        self.tasks: list | None = None

    def task(self, req: dict):
        if req.get("task_idx") is not None:
            if self.tasks is None:
                self.tasks = list(self.env.taskset)          # (load order, each task's idx set: verifiers' own)
            idx = int(req["task_idx"])
            if not 0 <= idx < len(self.tasks):
                n = len(self.tasks)
                raise IndexError(f"task_idx {idx}: the taskset has {n} tasks (0 .. {n - 1})")
            return self.tasks[idx]
        task_cls = type(self.env.taskset).task_type()
        data = task_cls.data_type().model_validate(req["task_data"])
        return task_cls(data, self.env.config.taskset.task)    # (what EnvServer._build_task does with wire data)


def _why(e: Exception) -> str:
    return " ".join([type(e).__name__ + ":", *(line.strip() for line in str(e).splitlines()[:3])]).strip()


def check(config: dict) -> dict | None:
    """What is wrong with an environment config, resolved as Loaded resolves it but not loaded (no data, no
    serving: the agent's preflight): {"field": its key under env (None: the config), "error"}, or None."""
    from verifiers.v1.utils.loaders import resolve_env_config, taskset_class

    taskset = config.get("taskset")
    taskset_id = taskset.get("id") if isinstance(taskset, dict) else None
    if taskset_id:
        try:
            taskset_class(str(taskset_id))
        except Exception as e:  # noqa: BLE001 - the taskset's failure is the answer
            return {"field": "taskset.id", "error": _why(e)}
    try:
        resolve_env_config(config)
    except Exception as e:  # noqa: BLE001 - verifiers' refusal is the answer
        return {"field": None, "error": _why(e)}
    return None


class VerifiersBridge:
    def __init__(self, out) -> None:
        self.out = out
        self.write = threading.Lock()
        self.envs: dict[str, Loaded] = {}
        self.loading = asyncio.Lock()
        self.stack = contextlib.AsyncExitStack()
        self.running: dict[Any, asyncio.Task] = {}

    async def env(self, config: dict) -> Loaded:
        key = json.dumps(config, sort_keys=True)
        async with self.loading:
            if key not in self.envs:
                loaded = Loaded(config)
                await self.stack.enter_async_context(loaded.env.serving())
                self.envs[key] = loaded
            return self.envs[key]

    async def run(self, req: dict) -> dict:
        from verifiers.v1.clients import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig, TrainClientConfig
        from verifiers.v1.types import SamplingConfig

        loaded = await self.env(req["env"])
        task = loaded.task(req)
        # The episode's key reaches the endpoint as verifiers sends every key: read from an environment variable
        # the client config names (verifiers.v1.configs.client.resolve_api_key). One variable per episode, so
        # each episode's calls carry its own key; the client built for it is closed when the episode ends.
        var = f"RLFLOW_EPISODE_KEY_{uuid.uuid4().hex}"
        os.environ[var] = req["key"]
        client = dict(req["client"], api_key_var=var)
        config = TrainClientConfig(**client) if client.get("type") == "train" else EvalClientConfig(**client)
        ctx = ModelContext(model=req["model"], client=config, sampling=SamplingConfig(**(req.get("sampling") or {})))
        try:
            (slot,) = loaded.env.slots(task)
            episode = await loaded.env.run_slot(slot, ctx)
        finally:
            os.environ.pop(var, None)
            await _close_clients(loaded.env, var)
        return summary(episode, tokens=bool(req.get("tokens")))

    async def handle(self, req: dict) -> Any:
        op = req["op"]
        if op == "run":
            return await self.run(req)
        if op == "tasks":
            loaded = await self.env(req["env"])
            return [task.data.model_dump(mode="json", exclude_none=True) for task in loaded.env.taskset]
        if op == "check":
            return check(req["env"])
        if op == "cancel":
            task = self.running.get(req["target"])
            if task is not None:
                task.cancel()
            return task is not None
        raise ValueError(f"unknown op {op!r}")

    async def serve(self, line: str) -> None:
        req: dict = {}
        try:
            req = json.loads(line)
            self.running[req["id"]] = asyncio.current_task()
            reply = {"id": req["id"], "ok": await self.handle(req)}
        except asyncio.CancelledError:
            reply = {"id": req.get("id"), "error": "CancelledError: the episode was cancelled"}
        except Exception as e:  # noqa: BLE001 - the episode's failure, reported to rlflow
            text = str(e).splitlines()[0] if str(e) else ""
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {text}".strip()}
        finally:
            self.running.pop(req.get("id"), None)
        out = json.dumps(reply, default=str)
        with self.write:
            self.out.write(out + "\n")
            self.out.flush()


async def _close_clients(env, var: str) -> None:
    """Close the model clients verifiers' interception servers built for one episode's config (they are
    keyed by the config's JSON, which names the episode's variable, and otherwise live, each with its
    keep-alive connections to rlflow's endpoint, as long as the servers do)."""
    interception = getattr(env, "_interception", None)
    servers = getattr(interception, "servers", None) or ([interception] if interception is not None else [])
    for server in servers:
        for key in [k for k in getattr(server, "clients", {}) if var in k]:
            with contextlib.suppress(Exception):
                await server.clients.pop(key).close()


def summary(episode, tokens: bool = False) -> dict:
    """What rlflow keeps of an episode: per trace its rewards, metrics, stop condition and errors, and with
    `tokens` the token spans verifiers recorded (the endpoint records the same calls under the episode's key;
    these are for checking one against the other)."""
    traces = []
    for trace in episode.traces:
        traces.append({
            "id": trace.id,
            "agent": getattr(trace.agent, "name", None),
            "ok": trace.ok,
            "reward": trace.reward if trace.rewards and None not in trace.rewards.values() else None,
            "rewards": {k: None if r is None else {"score": r.score, "weight": r.weight}
                        for k, r in trace.rewards.items()},
            "metrics": dict(trace.metrics),
            "stop_condition": trace.stop_condition,
            "is_timeout": trace.is_timeout,
            "turns": trace.num_turns,
            "calls": len(trace.calls),
            "errors": [f"{e.type}: {e.message}" for e in trace.errors],
            "call_errors": [f"{c.error.type}: {c.error.message}" for c in trace.calls if c.error is not None],
            "last_reply": trace.last_reply,
        })
        if tokens:
            traces[-1]["branches"] = [{"token_ids": b.token_ids, "sampled_mask": b.sampled_mask,
                                       "logprobs": b.logprobs} for b in trace.branches]
    return {"ok": episode.ok, "env": episode.env.id, "errors": [f"{e.type}: {e.message}" for e in episode.errors],
            "is_timeout": episode.is_timeout, "traces": traces}


def main() -> None:
    # The replies get stdout to themselves: whatever an environment prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    bridge = VerifiersBridge(out)

    def read() -> None:
        for line in sys.stdin:
            if line.strip():
                loop.call_soon_threadsafe(lambda line=line: loop.create_task(bridge.serve(line)))
        loop.call_soon_threadsafe(loop.stop)                 # rlflow closed the pipe: done

    import verifiers.v1  # noqa: F401 - (fail here, at once, where it is not installed)

    out.write(json.dumps({"id": None, "ok": "ready"}) + "\n")
    out.flush()
    threading.Thread(target=read, daemon=True).start()
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(bridge.stack.aclose())       # (interception and tool servers down, in order)


if __name__ == "__main__":
    main()

"""OpenEnv environments, over their servers' own protocol through openenv-core's client (docs/environments.md).

    env:
      factory: "tasks.envs.adapters.openenv_adapter:OpenEnv"
      kwargs: {base_url: "http://127.0.0.1:8000", action_field: "message"}
      isolation: thread            # the environment runs in its server already; this is only its client

An OpenEnv environment is a server (HTTP and WebSocket, usually in a container) and each episode is one
session of openenv-core's `EnvClient`: `reset(**kwargs)`, then `step(action)` until the result says done.
openenv-core pins packages that clash with Prefect's (Makefile), so its client runs in a Python of its own,
`.venv-openenv` (make setup builds it), in one bridge process per rlflow process
(tasks/envs/adapters/openenv_bridge.py), which holds the sessions of all the episodes of that process and runs
their calls concurrently.
More: docs/internals.md (tasks/envs/adapters/openenv_adapter.py): clients, resets, actions, observations, failures.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from tasks.core.contracts import Step
from tasks.core.errors import UserError
from tasks.core.paths import sibling_python
from tasks.core.processes import run
from tasks.envs.adapters.bridge import LineBridge
from tasks.envs.runtime.isolation import EnvironmentDied
from tasks.envs.runtime.protocol import require_answer

VENV = ".venv-openenv"
BRIDGE = Path(__file__).with_name("openenv_bridge.py")
NO_OPENENV = 3                # the bridge's --probe exit code where openenv-core is not installed


class OpenEnvError(RuntimeError):
    """The server or its client refused a call: the text is theirs."""


class _OpenEnvClient(LineBridge):
    """The client's process of one Python (one per rlflow process, started at first use, again if it died)."""

    what = "the OpenEnv client's process"
    error = OpenEnvError

    def __init__(self, python: str) -> None:
        self.start(python, BRIDGE)

    def call(self, deadline_s: float, **request: Any) -> Any:
        self.ready.result(timeout=deadline_s)           # (its imports: ~4 s, once)
        return self.send(**request)[1].result(timeout=deadline_s)


def openenv_python(python: str | None) -> str | None:
    return python or sibling_python(VENV)


def _columns(reset_columns: Any) -> list[str]:
    """env.kwargs.reset_columns as given (None: ["seed"], where the data has one), or one line."""
    if reset_columns is None:
        return ["seed"]
    if not isinstance(reset_columns, list | tuple) or not all(isinstance(c, str) and c for c in reset_columns):
        raise UserError(f"env.kwargs.reset_columns: expected a list of the data's column names, e.g. [seed]; got "
                        f"{reset_columns!r}")
    return list(reset_columns)


def _probe(exe: str, client: str, action: str | None) -> dict:
    """openenv-core, env.kwargs.client and env.kwargs.action looked for in the OpenEnv Python (openenv_bridge.py
    --probe); one line naming what is missing."""
    import subprocess

    try:
        probe = run([exe, str(BRIDGE), "--probe", json.dumps({"client": client, "action": action})],
                    capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise UserError(f"env.kwargs.client: importing {client}{f' and {action}' if action else ''} in {exe} did "
                        f"not finish in 60 s") from None
    if probe.returncode == NO_OPENENV and not probe.stdout.strip():
        raise UserError(f"env.kwargs.python: {exe} has no openenv-core (pip install openenv-core there; make "
                        f"setup does for {VENV})")
    lines = probe.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1])
    except (IndexError, ValueError):
        found = None
    if not isinstance(found, dict) or found.get("importing"):
        tail = (probe.stderr.strip().splitlines() or [""])[-1]
        if found:        # (it began importing the classes named, and never answered: an import ended its process)
            raise UserError(f"env.kwargs.client: importing {client}{f' and {action}' if action else ''} in {exe} "
                            f"ended its process (exit {probe.returncode}) before an answer; expected modules that "
                            f"import without exiting {tail}".strip())
        raise UserError(f"env.kwargs.python: {exe} could not look for env.kwargs.client and action (exit "
                        f"{probe.returncode}) {tail}".strip())
    if found.get("client"):
        raise UserError(f"env.kwargs.client: {found['client']}; expected module:Class naming an OpenEnv client "
                        f"class (an EnvClient, with connect, reset and step) importable in {exe}, e.g. "
                        f"openenv.core:GenericEnvClient")
    if found.get("action"):
        raise UserError(f"env.kwargs.action: {found['action']}; expected module:Class naming the environment's "
                        f"action class (its pydantic Action) importable in {exe}, or none (actions sent as dicts)")
    return found


def _server_schema(base_url: str) -> dict | None:
    """The action's JSON schema as the server says it (GET /schema: openenv-core's servers), if it does."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url.rstrip("/") + "/schema", timeout=10) as response:
            schema = json.loads(response.read(1_000_000)).get("action")
    except Exception:  # noqa: BLE001 - a server without one: the field is not checked
        return None
    return schema if isinstance(schema, dict) else None


_CHECKED: set[str] = set()    # the preflights that passed in this process (preflight: the probe and /schema, once)


class OpenEnv:
    """rlflow's protocol over one OpenEnv session per episode."""

    def __init__(self, base_url: str, client: str = "openenv.core:GenericEnvClient", action: str | None = None,
                 action_field: str = "message", observation_field: str | None = None,
                 reset_columns: list[str] | None = None, python: str | None = None, timeout: float = 60.0):
        self.base_url, self.client, self.action_class = base_url, client, action
        self.action_field, self.observation_field = action_field, observation_field
        self.reset_columns, self._columns_named = _columns(reset_columns), reset_columns is not None
        self.python, self.timeout = openenv_python(python), timeout
        self.observation: Any = None
        self.done = False
        self._bridge: _OpenEnvClient | None = None
        self._session = uuid.uuid4().hex

    @classmethod
    def preflight(cls, base_url: str | None = None, python: str | None = None,
                  client: str = "openenv.core:GenericEnvClient", action: str | None = None,
                  action_field: str = "message", reset_columns: Any = None, **_: Any) -> None:
        """Before the run starts: one line when the OpenEnv Python or the server is missing, when env.kwargs.client
        or action names no class there, or the action has no field action_field, or reset_columns is no list.
        Called again at every run_episodes: what passed (the probe's process, the server's /schema) is not looked
        for again in this process; the server is asked whether it answers each time."""
        columns = _columns(reset_columns)
        if not isinstance(action_field, str) or not action_field:
            raise UserError(f"env.kwargs.action_field: expected the name of the action's field a reply's text is "
                            f"sent in (e.g. message); got {action_field!r}")
        exe = openenv_python(python)
        if exe is None or not os.access(exe, os.X_OK):
            where = f"{python!r} is not an executable" if python else f"no {VENV} was found"
            raise UserError(f"env.kwargs.python: {where}; the OpenEnv adapter runs openenv-core's client in a Python "
                            f"of its own (make setup builds {VENV})")
        key = json.dumps([exe, client, action, action_field, base_url, columns, os.environ.get("PYTHONPATH")],
                         default=str)        # (what the probe imports: its PYTHONPATH too)
        found = {} if key in _CHECKED else _probe(exe, client, action)
        if not base_url:
            raise UserError("env.kwargs.base_url: the OpenEnv adapter needs the environment server's URL, e.g. "
                            "http://127.0.0.1:8000")
        require_answer(base_url.rstrip("/") + "/health", "OpenEnv server")
        if key in _CHECKED:
            return
        schema = found.get("schema") if action else _server_schema(base_url)
        fields = (schema or {}).get("properties")
        if isinstance(fields, dict) and fields and schema.get("additionalProperties") is False \
                and action_field not in fields:
            whose = f"env.kwargs.action {action}" if action else f"the server's action ({base_url}/schema)"
            raise UserError(f"env.kwargs.action_field: {action_field!r} is not a field of {whose}, which has "
                            f"{sorted(fields)}; expected the one a reply's text is sent in")
        _CHECKED.add(key)

    @classmethod
    def check_row(cls, row: dict, which: str, /, reset_columns: Any = None, **_: Any) -> None:
        """Each column env.kwargs.reset_columns names is one of `row`'s (the first of each split the run reads, in
        the preflight; each row an episode resets on): one line, not the column left out of every reset. The
        default (seed) is passed where a row has it."""
        if reset_columns is not None and (lacks := [c for c in _columns(reset_columns) if c not in row]):
            raise UserError(f"env.kwargs.reset_columns: {lacks[0]!r} is not a column of the {which} (its rows "
                            f"have {sorted(row)}); expected the columns passed to the server's reset")

    def _call(self, op: str, **request: Any) -> Any:
        return self._bridge.call(self.timeout, op=op, session=self._session, **request)

    def reset(self, row: dict) -> list[dict]:
        self.check_row(row, "data", reset_columns=self.reset_columns if self._columns_named else None)
        self._bridge = _OpenEnvClient.of(self.python)
        self._call("open", client=self.client, action=self.action_class, base_url=self.base_url,
                   timeout=self.timeout)
        result = self._call("reset", kwargs={c: row[c] for c in self.reset_columns if c in row})
        self.observation, self.done = result["observation"], result["done"]
        text, prompt = self._text(result["observation"]), row.get("prompt")
        if isinstance(prompt, list):
            return [*prompt, {"role": "user", "content": text}]
        return [{"role": "user", "content": "\n\n".join(t for t in (str(prompt or "").strip(), text) if t)}]

    def step(self, message: dict) -> Step:
        calls = [c for c in message.get("tool_calls") or [] if c.get("type") == "function"]
        action = dict(calls[0]["function"]["arguments"]) if calls else {self.action_field: message.get("content") or ""}
        try:
            result = self._call("step", action=action)
        except OpenEnvError as e:
            if calls or not any(k in str(e) for k in ("VALIDATION_ERROR", "ValidationError")):
                raise
            raise OpenEnvError(f"{e} (the action sent: {{{self.action_field!r}: the reply's text}}, "
                               f"env.kwargs.action_field)") from None
        self.observation, self.done = result["observation"], result["done"]
        reward = float(result["reward"] or 0.0)
        if self.done:
            return Step([], reward, True)
        return Step([{"role": "user", "content": self._text(result["observation"])}], reward, False)

    def close(self) -> None:
        if self._bridge is not None:
            try:
                self._call("close")
            except (OpenEnvError, EnvironmentDied, TimeoutError):
                pass                                 # (the session ends with the server's side of it anyway)

    def _text(self, observation: Any) -> str:
        if not isinstance(observation, dict):
            return str(observation)
        if self.observation_field:
            return str(observation.get(self.observation_field, ""))
        fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
        texts = [v for v in fields.values() if isinstance(v, str)]
        return texts[0] if len(fields) == 1 and texts else json.dumps(fields, default=str)

"""The environment server: episodes' environments on a machine of their own (env.where: local | sky), the
generate and evaluate stages' episode loops talking to it over HTTP. The model, its tokens and the chat
template stay in the stage; only the protocol's calls travel (docs/environments.md#where-environments-run).

    python -m tasks.envs.runtime.server --config C [--overrides-json J] [--host 0.0.0.0] [--port 8330]
                                        [--idle-minutes 30] [--exit-with-parent]

The flow starts it (flows/services.py: EnvServer), here or on a CPU spot cluster (sky/env.yaml), and hands its URL
and token to the stages as RLFLOW_ENV_SERVER and RLFLOW_ENV_TOKEN; or run it yourself and set env.where to its URL.
Routes: GET /health, POST /episodes, POST /episodes/ID/reset|step|close, DELETE /episodes/ID. An environment's
failure fails its episode as it would in the stage; a server that does not answer fails the stage (ServerGone).
With env.servers: N the flow puts N of these behind one front (tasks/envs/runtime/pool.py). The server leaves after
--idle-minutes without a request.
More: docs/internals.md (tasks/envs/runtime/server.py): the routes in full, failures, pools, forgotten episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

from tasks.core.daemon import Watch, leave
from tasks.core.errors import UserError, user_error_line
from tasks.core.fleet import authorized, bearer
from tasks.core.placement import ENV_TOKEN_VAR as TOKEN_VAR  # (the server's own token: the stages' too)
from tasks.core.placement import ENV_URL_VAR as URL_VAR  # noqa: F401 - the server's URL, as its callers name it
from tasks.core.process_wide import renew_output_budget
from tasks.core.serving import listening_socket, server_arguments
from tasks.envs.runtime.isolation import (
    Caller,
    EnvironmentDied,
    EnvironmentFailed,
    InvalidReply,
    start_environment,
    warm_up,
    why,
)
from tasks.envs.runtime.protocol import as_step, factory_of

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.placement import Services

READY = "RLFLOW_ENV_SERVER_READY"          # the line the server prints once it answers: READY <url>
DEFAULT_PORT = 8330
SLACK_SECONDS = 60.0                       # an episode untouched for env.timeout_seconds + this is abandoned


class ServerGone(RuntimeError):
    """The environment server did not answer (refused, reset, timed out): the stage fails and is retried."""


class ServerRefused(UserError):
    """The environment server refused the token: the stage's user error (one line, exit 2), not an episode's."""


# ------------------------------------------------------------------------------------------ the server

class _Hosted:
    def __init__(self, env: Any):
        self.env, self.touched, self.busy = env, time.monotonic(), 0


class Episodes:
    """The live environments, by id; each call on a thread of the episode loop's caller (sync calls on daemon
    threads, coroutines on one event loop), so a slow environment never holds up the server's own loop."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.make = factory_of(cfg)                 # the factory's preflight: one line, exit 2, before READY
        if cfg.env.isolation == "process":
            warm_up(cfg)
        self.caller = Caller(4096)
        self.live: dict[str, _Hosted] = {}
        self.last_request = time.monotonic()

    async def call(self, fn, *args):
        return await asyncio.wrap_future(self.caller.start(fn, *args))

    async def open(self, row: dict) -> dict:
        if not self.live:               # (a new stage's episodes, most likely: what they print is bounded anew)
            renew_output_budget()
        env = await self.call(start_environment, self.cfg, self.make, row)
        key = uuid.uuid4().hex
        self.live[key] = _Hosted(env)
        return {"id": key, "tools": env.tool_schemas}

    async def run(self, key: str, op: str, arg: Any) -> Any:
        hosted = self.live[key]
        hosted.busy += 1
        hosted.touched = time.monotonic()
        try:
            env = hosted.env
            if op == "reset":
                return await self.call(env.reset, arg)
            if op == "step":
                return _as_tuple(await self.call(env.step, arg))
            return await self.call(self._close, key, env)
        finally:
            hosted.busy -= 1
            hosted.touched = time.monotonic()

    def _close(self, key: str, env: Any):
        self.live.pop(key, None)
        value = env.close()
        return _then(value, env) if inspect.isawaitable(value) else env.state

    def kill(self, key: str) -> None:
        hosted = self.live.pop(key, None)
        if hosted is not None:
            hosted.env.kill()

    def sweep(self) -> None:
        """Kill what the stages abandoned (a stage process that died mid-episode never closes its episodes)."""
        limit = self.cfg.env.timeout_seconds + SLACK_SECONDS
        now = time.monotonic()
        for key, hosted in list(self.live.items()):
            if hosted.busy == 0 and now - hosted.touched > limit:
                threading.Thread(target=self.kill, args=(key,), daemon=True).start()


async def _then(value, env):
    await value
    return env.state


def _as_tuple(value) -> tuple:
    try:
        st = as_step(value)
    except TypeError as e:
        raise InvalidReply(str(e)) from None
    return st.observation, st.reward, st.done, st.info


def _failure(e: BaseException) -> dict:
    if isinstance(e, EnvironmentDied):
        return {"error": str(e), "kind": "died"}
    if isinstance(e, InvalidReply):
        return {"error": str(e), "kind": "invalid"}
    return {"error": str(e) if isinstance(e, EnvironmentFailed) else why(e), "kind": "failed"}


def _json(value: Any) -> Any:
    """What the environment returned, as JSON (an info dict may hold anything: its text then)."""
    return json.loads(json.dumps(value, default=str))


def beside(housekeeping, on_ready=None):
    """A Starlette lifespan that runs the coroutine function `housekeeping` beside the server while it serves (then
    cancels it) and calls `on_ready` once it is up: the environment server's and the pool front's."""
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        task = asyncio.get_running_loop().create_task(housekeeping())
        if on_ready is not None:
            on_ready()
        yield
        task.cancel()
    return lifespan


def app(episodes: Episodes, token: str | None, idle_seconds: float | None = None, on_ready=None,
        parent: int | None = None):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    def denied(request: Request) -> JSONResponse | None:
        episodes.last_request = time.monotonic()
        if not authorized(request.headers, token):
            return JSONResponse({"error": "missing or wrong token"}, status_code=401)
        return None

    async def health(request: Request):
        return JSONResponse({"factory": episodes.cfg.env.factory, "isolation": episodes.cfg.env.isolation,
                             "episodes": len(episodes.live)})

    async def open_episode(request: Request):
        if (no := denied(request)) is not None:
            return no
        body = await request.json()
        try:
            return JSONResponse(_json(await episodes.open(body.get("row") or {})))
        except BaseException as e:  # noqa: BLE001 - the episode's failure, the client raises it
            return JSONResponse(_failure(e))

    async def call(request: Request):
        if (no := denied(request)) is not None:
            return no
        key, op = request.path_params["key"], request.path_params["op"]
        if op not in ("reset", "step", "close"):
            return JSONResponse({"error": f"no call {op!r}"}, status_code=404)
        if key not in episodes.live:
            return JSONResponse({"error": "the environment's episode is gone (killed, or the server restarted)",
                                 "kind": "died"})
        body = await request.json() if op != "close" else {}
        try:
            return JSONResponse({"value": _json(await episodes.run(key, op, body.get("arg")))})
        except BaseException as e:  # noqa: BLE001
            return JSONResponse(_failure(e))

    async def kill(request: Request):
        if (no := denied(request)) is not None:
            return no
        await asyncio.to_thread(episodes.kill, request.path_params["key"])
        return JSONResponse({"killed": True})

    # When to leave (the daemon helper, tasks/core/daemon.py): unused (no request, no live episode) for
    # idle_seconds, or the flow that started it (--exit-with-parent) gone. No state file: the flow holds it.
    watch = Watch(idle=idle_seconds, parent=parent,
                  unused=lambda: None if episodes.live else time.monotonic() - episodes.last_request)

    async def housekeeping():
        while True:
            await asyncio.sleep(5.0)
            episodes.sweep()
            if (reason := watch.check()) is not None:
                with contextlib.suppress(OSError):    # (its output is a pipe to the flow, which may be gone)
                    print(f"no request for {idle_seconds / 60:g} minutes: the environment server leaves"
                          if reason == "idle" else "the flow that started the environment server is gone: it leaves",
                          flush=True)
                try:
                    leave()
                except OSError:                       # (flushing into that pipe: it leaves all the same)
                    os._exit(0)

    return Starlette(routes=[Route("/health", health), Route("/episodes", open_episode, methods=["POST"]),
                             Route("/episodes/{key}/{op}", call, methods=["POST"]),
                             Route("/episodes/{key}", kill, methods=["DELETE"])],
                     lifespan=beside(housekeeping, on_ready))


def main(argv: list[str] | None = None) -> int:
    from tasks.core.config import load_config
    from tasks.core.stage import parse_overrides_json, quiet_progress_bars

    ap = server_arguments("python -m tasks.envs.runtime.server", __doc__, DEFAULT_PORT)
    args = ap.parse_args(argv)
    quiet_progress_bars()
    try:
        cfg = load_config(args.config, parse_overrides_json(args.overrides_json) + args.override)
        if not cfg.env.factory:
            raise UserError("env.factory: the environment server serves env.factory, and the config sets none")
        episodes = Episodes(cfg)
    except UserError as e:
        print(user_error_line(e), file=sys.stderr, flush=True)
        return 2
    import uvicorn

    sock, url = listening_socket(args.host, args.port)

    def ready() -> None:
        print(f"{READY} {url}", flush=True)

    server = uvicorn.Server(uvicorn.Config(app(episodes, os.environ.get(TOKEN_VAR) or None,
                                               args.idle_minutes * 60 or None, ready,
                                               os.getppid() if args.exit_with_parent else None),
                                           log_level="warning", access_log=False, lifespan="on"))
    server.run(sockets=[sock])
    return 0


# ------------------------------------------------------------------------------------------ the client

_pools: dict[tuple[str, str], Any] = {}
_pools_lock = threading.Lock()


class _Clients:
    """HTTP clients for one server, each lent to one call at a time: a connection is never shared by two
    threads (httpx's pool, shared by the episode loop's many threads, now and then hands a connection that
    another thread is closing: `Bad file descriptor`), and each client keeps its connection alive between
    the calls it serves."""

    def __init__(self, cfg: Config, url: str, token: str):
        self.cfg, self.base_url, self.token = cfg, url, token
        self.idle: list = []
        self.lock = threading.Lock()

    def _new(self):
        import httpx

        return httpx.Client(base_url=self.base_url,
                            headers=bearer(self.token),
                            timeout=httpx.Timeout(self.cfg.env.timeout_seconds + SLACK_SECONDS, connect=10.0),
                            transport=httpx.HTTPTransport(retries=2))     # (connection attempts only)

    def request(self, method: str, path: str, **kwargs):
        with self.lock:
            client = self.idle.pop() if self.idle else None
        client = client or self._new()
        try:
            response = client.request(method, path, **kwargs)
        except BaseException:
            client.close()
            raise
        with self.lock:
            self.idle.append(client)
        return response


def server_of(cfg: Config, services: Services | None = None) -> tuple[str, str]:
    """The URL and token the episodes use: the server the flow started (the stage's `services`; a stage without
    a context: its process's environment, as a stage process is given them), else env.where's URL and
    RLFLOW_ENV_TOKEN."""
    from tasks.core.placement import Services, placement_of

    services = Services.given(services)
    if services.env_url:
        return services.env_url.rstrip("/"), services.env_token
    place = placement_of(cfg)
    if place.env != "yours":
        raise UserError(f"env.where: {place.env}: no environment server given; the flow starts one and hands "
                        f"it to its stages (run the stage through `rlflow run`, or set env.where to its URL)")
    return cfg.env.url.rstrip("/"), Services.from_environment().env_token


def _client(cfg: Config, server: tuple[str, str]) -> _Clients:
    url, token = server
    with _pools_lock:
        if (url, token) not in _pools:
            _pools[url, token] = _Clients(cfg, url, token)
        return _pools[url, token]


class RemoteEnvironment:
    """One episode's environment on the server: what ProcessEnvironment is to a local process (same methods,
    same exceptions), so the episode loop cannot tell them apart."""

    def __init__(self, client, key: str, tools: list[dict]):
        self.client, self.key, self.tool_schemas = client, key, tools
        self.state: dict | None = None

    @classmethod
    def start(cls, cfg: Config, row: dict, server: tuple[str, str]) -> RemoteEnvironment:
        client = _client(cfg, server)
        reply = _reply(client, "POST", "/episodes", {"row": row})
        return cls(client, reply["id"], reply.get("tools") or [])

    def reset(self, row: dict) -> list[dict]:
        return _reply(self.client, "POST", f"/episodes/{self.key}/reset", {"arg": row})["value"]

    def step(self, message: dict):
        return tuple(_reply(self.client, "POST", f"/episodes/{self.key}/step", {"arg": message})["value"])

    def close(self, failed: bool = False) -> None:
        if failed:
            self.kill()
            return
        self.state = _reply(self.client, "POST", f"/episodes/{self.key}/close", {})["value"]

    def kill(self) -> None:
        """Ask the server to kill it (a call past the deadline, a failed episode); never waits for the answer."""
        def ask() -> None:
            try:
                self.client.request("DELETE", f"/episodes/{self.key}", timeout=10.0)
            except Exception:  # noqa: BLE001 - the sweep kills what this does not reach
                pass
        threading.Thread(target=ask, daemon=True, name="env-kill").start()


def _reply(client, method: str, path: str, body: dict) -> dict:
    import httpx

    try:
        response = client.request(method, path, json=_json(body))
    except httpx.HTTPError as e:
        raise ServerGone(f"the environment server at {client.base_url} did not answer: {why(e)}") from None
    if response.status_code == 503:           # an environment pool with no server left (tasks/envs/runtime/pool.py)
        raise ServerGone(f"the environment server at {client.base_url} has none left: {response.text[:300]}")
    if response.status_code == 401:
        raise ServerRefused(f"env.where: the environment server at {client.base_url} refused the token "
                        f"({TOKEN_VAR})")
    try:
        reply = response.json()
    except ValueError:
        raise ServerGone(f"the environment server at {client.base_url} answered HTTP {response.status_code}, not "
                         f"JSON") from None
    if "error" in reply:
        kind = reply.get("kind")
        raise {"died": EnvironmentDied, "invalid": InvalidReply}.get(kind, EnvironmentFailed)(reply["error"])
    return reply


if __name__ == "__main__":
    sys.exit(main())

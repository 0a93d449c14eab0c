"""The environment pool's front: env.servers: N environment servers (tasks/envs/runtime/server.py) behind one URL, for
environments heavy enough to want many machines (a browser farm). It speaks exactly the server's routes, so the
stages' episodes (RemoteEnvironment) talk to it as they talk to one server; only their URL differs
(docs/environments.md#environment-pools).

    python -m tasks.envs.runtime.pool --config C [--overrides-json J] [--host 0.0.0.0] [--port 8330] [--idle-minutes 30]
                                      [--exit-with-parent] [--member URL]...

A new episode goes to the live member with the fewest open episodes, and its id carries its route. A lost member's
episodes fail alone ("died"); only with no member live does `POST /episodes` answer 503. The owner
(flows/services.py: EnvServer) replaces lost members and hands the front the table (`PUT /pool/members`).
Routes: those of server.py, with GET /health saying the pool's state, and PUT /pool/members.
Light on purpose (no torch, no environment imports): the front only forwards bytes.
More: docs/internals.md (tasks/envs/runtime/pool.py): routing, failures, replacement and the routes, in full.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any

from tasks.core.daemon import leave
from tasks.core.fleet import Health, authorized, bearer, least_loaded
from tasks.core.placement import ENV_TOKEN_VAR as TOKEN_VAR
from tasks.core.placement import ENV_URL_VAR as URL_VAR  # noqa: F401 - the front's URL, as its callers name it
from tasks.core.serving import listening_socket, server_arguments
from tasks.envs.runtime.server import READY, SLACK_SECONDS, beside

LOST = "of the pool was lost"              # in the error of an episode whose server was lost (episodes.py counts it)
PROBE_SECONDS = 2.0                        # each live member's /health, this often


def _say(line: str) -> None:
    """A line to the log (the flow reads it through a pipe): nothing when the flow is gone, which must not stop the
    front (it is about to leave: its parent is gone)."""
    with contextlib.suppress(OSError):
        print(line, flush=True)


def _leave() -> None:
    try:
        leave()
    except OSError:                    # (flushing into the pipe of a flow that is gone)
        os._exit(0)


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".strip().rstrip(":")


def episode_key(index: int, generation: int, inner: str) -> str:
    """A pool's id of an episode: "index.generation.inner" (the member, which start of it, the member's own id)."""
    return f"{index}.{generation}.{inner}"


def parse_episode_key(key: object) -> tuple[int, int, str] | None:
    """(index, generation, inner) of a pool's episode id; None for an id that is not one."""
    index, generation, inner = ((key if isinstance(key, str) else "").split(".", 2) + ["", ""])[:3]
    return (int(index), int(generation), inner) if index.isdigit() and generation.isdigit() and inner else None


class PoolMember:
    """One environment server of the pool, as the front sees it."""

    def __init__(self, index: int):
        self.index = index
        self.url: str | None = None
        self.generation = -1
        self.live = False
        self.why: str | None = "not started yet"
        self.episodes: dict[str, float] = {}      # its open episodes (the pool's ids) -> when last touched
        self.pending = 0                          # opens on their way to it
        self.routed = self.lost = 0
        self.health = Health()
        self.client = None                        # httpx.AsyncClient, made in the front's event loop

    def load(self) -> int:
        return len(self.episodes) + self.pending

    def view(self) -> dict:
        return {"index": self.index, "url": self.url, "live": self.live, "generation": max(self.generation, 0),
                "episodes": len(self.episodes), "routed": self.routed, "lost": self.lost, "why": self.why}


class Pool:
    def __init__(self, size: int, token: str | None, call_timeout: float, sweep_after: float):
        self.members = [PoolMember(i) for i in range(size)]
        self.token, self.call_timeout, self.sweep_after = token, call_timeout, sweep_after
        self.last_request = time.monotonic()

    # ------------------------------------------------------------------------------------------ the table

    def set_members(self, specs: list[dict | None]) -> list:
        """The owner's table; returns the clients of replaced members (to be closed)."""
        if len(specs) != len(self.members):
            raise ValueError(f"the pool has {len(self.members)} members, the table {len(specs)}")
        retired = []
        for m, spec in zip(self.members, specs):
            url = (spec or {}).get("url")
            generation = int((spec or {}).get("generation", 0))
            if url and (url.rstrip("/"), generation) == (m.url, m.generation):
                continue                          # unchanged (a member the front lost stays lost till replaced)
            if m.live and m.episodes:
                m.lost += len(m.episodes)
            if m.client is not None:
                retired.append(m.client)
            m.client, m.episodes, m.health = None, {}, Health()
            m.url, m.generation = (url.rstrip("/"), generation) if url else (None, generation)
            m.live, m.why = bool(url), None if url else "not started"
        return retired

    def lose(self, m: PoolMember, why: str, generation: int) -> None:
        if not m.live or m.generation != generation:
            return                                # (already known, or said of the member it replaced)
        m.live, m.why = False, why
        m.lost += len(m.episodes)
        m.episodes = {}
        _say(f"environment server {m.index} {LOST}: {why}")

    def _client(self, m: PoolMember):
        import httpx

        if m.client is None:
            m.client = httpx.AsyncClient(
                base_url=m.url, headers=bearer(self.token),
                timeout=httpx.Timeout(self.call_timeout, connect=10.0),
                # (kept-alive connections dropped after 2 s idle: before the server closes them, at uvicorn's 5 s)
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128, keepalive_expiry=2.0))
        return m.client

    def health(self) -> dict:
        ms = self.members
        return {"pool": True, "size": len(ms), "live": sum(m.live for m in ms),
                "episodes": sum(len(m.episodes) for m in ms), "routed": sum(m.routed for m in ms),
                "lost": sum(m.lost for m in ms), "replaced": sum(max(m.generation, 0) for m in ms),
                "members": [m.view() for m in ms]}

    # ------------------------------------------------------------------------------------------ forwarding

    async def open(self, body: bytes) -> tuple[int, Any]:
        for _ in range(2 * len(self.members) + 2):
            live = [m for m in self.members if m.live]
            if not live:
                break
            m = least_loaded(live, lambda x: (x.load(), x.routed, x.index))
            generation = m.generation
            m.pending += 1
            try:
                r = await self._client(m).post("/episodes", content=body,
                                               headers={"content-type": "application/json"})
            except Exception as e:  # noqa: BLE001 - httpx's TransportError, or what httpcore lets out on a
                await self.failed(m, e, generation)         # socket torn down mid-connect (AttributeError)
                continue                          # (nothing was opened there that anyone will use: again)
            finally:
                m.pending -= 1
            try:
                reply = r.json()
            except ValueError:
                return r.status_code, r.content
            if r.status_code == 200 and "id" in reply:
                reply["id"] = episode_key(m.index, generation, reply["id"])
                if m.live and m.generation == generation:     # (else lost meanwhile: its calls answer "died")
                    m.episodes[reply["id"]] = time.monotonic()
                    m.routed += 1
            return r.status_code, reply
        return 503, {"error": f"no environment server of the pool answers ({len(self.members)} lost)"}

    async def failed(self, m: PoolMember, e: BaseException, generation: int) -> bool:
        """A request to m failed without an answer: m is lost, unless it answers /health on a connection of its own
        (what broke was one connection: a kept-alive one the server was closing). Whether it was lost."""
        import httpx

        if not isinstance(e, httpx.ConnectError | httpx.ConnectTimeout):
            with contextlib.suppress(Exception):
                async with httpx.AsyncClient(timeout=5.0) as fresh:
                    if (await fresh.get(f"{m.url}/health")).status_code == 200:
                        return False
        self.lose(m, _why(e), generation)
        return True

    def _route(self, key: str) -> tuple[PoolMember | None, str, str | None]:
        """(member, the member's id, why the episode is gone) for a pool id."""
        parts = parse_episode_key(key)
        if parts is None or parts[0] >= len(self.members):
            return None, "", "the environment's episode is gone (not an id of this pool)"
        index, generation, inner = parts
        m = self.members[index]
        if m.generation != generation:
            return None, "", f"environment server {m.index} {LOST} and replaced"
        if not m.live:
            return None, "", f"environment server {m.index} {LOST}: {m.why}"
        return m, inner, None

    async def call(self, key: str, op: str, body: bytes) -> tuple[int, Any]:
        import httpx

        m, inner, gone = self._route(key)
        if m is None:
            return 200, {"error": gone, "kind": "died"}
        generation = m.generation
        if key in m.episodes:
            m.episodes[key] = time.monotonic()
        try:
            r = await self._client(m).post(f"/episodes/{inner}/{op}", content=body,
                                           headers={"content-type": "application/json"})
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout):   # hung, or only slow: its health
            asyncio.get_running_loop().create_task(self.probe(m))          # check decides
            return 200, {"error": f"environment server {m.index} did not answer {op} within "
                                  f"{self.call_timeout:g} s", "kind": "failed"}
        except Exception as e:  # noqa: BLE001 - a TransportError, or httpcore's AttributeError (above)
            if await self.failed(m, e, generation):
                return 200, {"error": f"environment server {m.index} {LOST}: {_why(e)}", "kind": "died"}
            return 200, {"error": f"environment server {m.index}: the connection broke during {op} ({_why(e)}); "
                                  "the server still answers", "kind": "failed"}
        if op == "close":
            m.episodes.pop(key, None)
        return r.status_code, r.content

    async def kill(self, key: str) -> None:
        m, inner, _ = self._route(key)
        if m is None:
            return
        m.episodes.pop(key, None)
        with contextlib.suppress(Exception):       # the member's sweep kills what this does not reach
            await self._client(m).delete(f"/episodes/{inner}", timeout=10.0)

    async def probe(self, m: PoolMember) -> None:
        """m's /health: refused at once, or failing twice, and m is lost."""
        import httpx

        generation = m.generation
        try:
            (await self._client(m).get("/health", timeout=5.0)).raise_for_status()
            m.health.answered()
        except Exception as e:  # noqa: BLE001 - refused: lost; a timeout, a broken connection, an HTTP error: twice
            if m.health.failed(refused=isinstance(e, httpx.ConnectError)):
                self.lose(m, _why(e) if isinstance(e, httpx.ConnectError) else f"health check: {_why(e)}",
                          generation)

    async def housekeeping(self) -> None:
        await asyncio.gather(*(self.probe(m) for m in self.members if m.live))
        now = time.monotonic()
        for m in self.members:                    # what the stages abandoned (the members sweep it too)
            for key in [k for k, t in m.episodes.items() if now - t > self.sweep_after]:
                m.episodes.pop(key, None)


# ------------------------------------------------------------------------------------------ the app

def app(pool: Pool, idle_seconds: float | None = None, on_ready=None, parent: int | None = None):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from tasks.core.daemon import Watch

    def denied(request: Request) -> JSONResponse | None:
        pool.last_request = time.monotonic()
        if not authorized(request.headers, pool.token):
            return JSONResponse({"error": "missing or wrong token"}, status_code=401)
        return None

    def answer(code: int, out: Any) -> Response:
        if isinstance(out, bytes):
            return Response(out, status_code=code, media_type="application/json")
        return JSONResponse(out, status_code=code)

    async def health(request: Request):
        return JSONResponse(pool.health())

    async def members(request: Request):
        if (no := denied(request)) is not None:
            return no
        try:
            specs = (await request.json())["members"]
            retired = pool.set_members(specs)
        except (ValueError, KeyError, TypeError) as e:
            return JSONResponse({"error": f"PUT /pool/members: {_why(e)}"}, status_code=400)
        for client in retired:
            with contextlib.suppress(Exception):
                await client.aclose()
        return JSONResponse(pool.health())

    async def open_episode(request: Request):
        if (no := denied(request)) is not None:
            return no
        return answer(*await pool.open(await request.body()))

    async def call(request: Request):
        if (no := denied(request)) is not None:
            return no
        key, op = request.path_params["key"], request.path_params["op"]
        if op not in ("reset", "step", "close"):
            return JSONResponse({"error": f"no call {op!r}"}, status_code=404)
        return answer(*await pool.call(key, op, await request.body()))

    async def kill(request: Request):
        if (no := denied(request)) is not None:
            return no
        await pool.kill(request.path_params["key"])
        return JSONResponse({"killed": True})

    # When to leave: as the server (unused for idle_seconds: no request, no open episode; or the flow gone)
    watch = Watch(idle=idle_seconds, parent=parent,
                  unused=lambda: None if any(m.episodes for m in pool.members)
                  else time.monotonic() - pool.last_request)

    async def housekeeping():
        while True:
            await asyncio.sleep(PROBE_SECONDS)
            try:
                await pool.housekeeping()
            except Exception as e:  # noqa: BLE001 - the next round tries again
                _say(f"environment pool: housekeeping failed: {_why(e)}")
            if (reason := watch.check()) is not None:
                _say(f"no request for {idle_seconds / 60:g} minutes: the environment pool leaves"
                     if reason == "idle" else "the flow that started the environment pool is gone: it leaves")
                _leave()

    return Starlette(routes=[Route("/health", health), Route("/pool/members", members, methods=["PUT"]),
                             Route("/episodes", open_episode, methods=["POST"]),
                             Route("/episodes/{key}/{op}", call, methods=["POST"]),
                             Route("/episodes/{key}", kill, methods=["DELETE"])],
                     lifespan=beside(housekeeping, on_ready))


def main(argv: list[str] | None = None) -> int:
    from tasks.core.config import load_config
    from tasks.core.errors import UserError, user_error_line
    from tasks.core.stage import parse_overrides_json

    ap = server_arguments("python -m tasks.envs.runtime.pool", __doc__, 8330)
    ap.add_argument("--member", action="append", default=[], metavar="URL",
                    help="a member's URL, for a pool run by hand (the flow sends its table: PUT /pool/members)")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, parse_overrides_json(args.overrides_json) + args.override)
    except UserError as e:
        print(user_error_line(e), file=sys.stderr, flush=True)
        return 2
    import uvicorn

    pool = Pool(len(args.member) or cfg.env.servers, os.environ.get(TOKEN_VAR) or None,
                cfg.env.timeout_seconds + SLACK_SECONDS, cfg.env.timeout_seconds + 2 * SLACK_SECONDS)
    if args.member:
        pool.set_members([{"url": url, "generation": 0} for url in args.member])
    sock, url = listening_socket(args.host, args.port)

    def ready() -> None:
        print(f"{READY} {url}", flush=True)

    server = uvicorn.Server(uvicorn.Config(app(pool, args.idle_minutes * 60 or None, ready,
                                               os.getppid() if args.exit_with_parent else None),
                                           log_level="warning", access_log=False, lifespan="on",
                                           # (longer than the stages' clients keep an idle connection, httpx's
                                           # 5 s: they drop it first, never sending on one this is closing)
                                           timeout_keep_alive=30))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The generate replicas' router, a daemon per run (tasks/engines/replicas.py: ensure_router starts it; the stages
reach it through RoutedSession): it starts its N members (tasks/engines/replica.py: a process here, or through the
flow's launch command a SkyPilot cluster each), loads the schedule's policy into each (version-checked), routes
the stages' requests (sticky by episode, new work to the least loaded), takes a failed or hung member out (its
requests cut off and sent again to the others) and replaces it, and leaves with the process that started it.

    python -m tasks.engines.replica_router --config-json FILE --port P --state S [--owner PID]

Routes: GET /health, GET /stats, POST /policy {policy, digest}, POST /sample {policy, digest, prompt_ids, params,
key}, POST /stream/<i>/stream|interrupt (generate.streaming's, to replica i). One concept: the router, its
members' lives and its HTTP front. More: docs/internals.md (tasks/engines/replicas.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.fleet import START_TRIES, Health, Starts, Sticky, bearer, least_loaded, start_server
from tasks.core.processes import how_it_ended, run
from tasks.engines.replicas import ANSWERING, LAUNCH_VAR, READY, TOKEN_VAR

if TYPE_CHECKING:
    from tasks.core.config import Config

LATE_GRACE = 10.0                         # s after the first replica loaded a policy before the others are late
STICKY_KEYS = 100_000
STOP_GRACE = 5.0                          # s a stopped router waits for the requests it forwards before it cuts them


# ------------------------------------------------------------------------------------------- the router

@dataclasses.dataclass
class RoutedReplica:
    index: int
    url: str | None = None
    proc: subprocess.Popen | None = None
    state: str = "starting"           # starting | loading | ready | dead (a late one is still loading)
    holds: tuple | None = None        # (policy, digest) it has loaded
    busy: int = 0
    routed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    replaced: int = 0
    failures: int = 0                 # policy loads that failed in a row (3: dead)
    starts: Starts = dataclasses.field(default_factory=Starts)   # its starts that failed in a row (fleet.py)
    health: Health = dataclasses.field(default_factory=Health)
    life: int = 0                     # which start of this replica (a failure seen late concerns an old one)
    loading: bool = False             # a thread of _load is at work on it (it loads whatever `want` becomes)
    calls: set = dataclasses.field(default_factory=set)   # its forwarded requests now: (loop, task), Router.forward


class Router:
    def __init__(self, cfg: Config, config_json: Path, launch: dict | None):
        import secrets

        self.cfg, self.config_json, self.launch = cfg, config_json, launch
        self.token = os.environ.get(TOKEN_VAR) or secrets.token_urlsafe(24)
        self.members = [RoutedReplica(i) for i in range(cfg.generate.replicas)]
        self.lock = threading.RLock()
        self.want: tuple | None = None                # (policy, digest) the schedule names now
        self.sticky = Sticky(STICKY_KEYS)
        self.counts = {"sticky": 0, "new": 0, "retried": 0, "replaced": 0}
        self.replace_seconds: list[float] = []
        self.lost_count = 0                     # members lost since it started (the flow says each new one)
        self.last_used = time.monotonic()
        self.changed = threading.Condition(self.lock)
        self.client = None                # the forwarding client (httpx.AsyncClient)
        self.stopping = threading.Event()  # set by stop_members: nothing is started or replaced after it

    # ------------------------------------------------------------------------------------------ members

    def _start(self, m: RoutedReplica) -> None:
        """Start member m (a process here, or through the flow's launch command) and load the wanted policy."""
        t0 = time.monotonic()
        try:
            if self.launch is None:
                proc, url, _ = start_server(["-m", "tasks.engines.replica", "--config-json", str(self.config_json),
                                             "--port", "0", "--exit-with-parent"], {TOKEN_VAR: self.token}, READY,
                                            f"replica {m.index}", f"replica {m.index}",
                                            lambda s: print(s, flush=True), self.cfg.generate.server_start_timeout)
            else:
                proc, url = None, self._launched(m.index)
            if self.stopping.is_set():             # (started while the router was stopping)
                self._stop(m.index, proc)
                return
            with self.lock:
                m.proc, m.url, m.state, m.holds, m.failures, m.health = proc, url, "loading", None, 0, Health()
                m.life = m.life + 1
                m.starts.started()
            print(f"replica {m.index}: up at {url} ({time.monotonic() - t0:.1f} s)", flush=True)
            self._load(m)
            if m.replaced:
                self.replace_seconds.append(time.monotonic() - t0)
        except Exception as e:  # noqa: BLE001 - a replica that cannot start is dead; the watch tries again
            print(f"replica {m.index}: did not start: {e}", flush=True)
            with self.lock:
                m.state = "dead"
                m.starts.failure(e)
                self.changed.notify_all()

    def _launched(self, i: int) -> str:
        port = str(int(self.launch.get("port_base", 0)) + i)
        argv = [a.replace("{cluster}", (self.launch.get("clusters") or [""] * (i + 1))[i]).replace("{i}", str(i))
                .replace("{port}", port).replace("{token}", self.token) for a in self.launch["start"]]
        ran = run(argv, {**os.environ, TOKEN_VAR: self.token}, capture_output=True, text=True)
        for line in reversed(ran.stdout.splitlines()):
            if line.startswith("{"):
                out = json.loads(line)
                if out.get("url"):
                    return out["url"]
                raise RuntimeError(out.get("error") or f"exit code {out.get('exit_code')}")
        raise RuntimeError(f"the launch command failed (exit code {ran.returncode}): {ran.stderr[-500:]}")

    def _load(self, m: RoutedReplica) -> None:
        """Have m load the wanted policy; ready once it holds it (late if the others were ready long before)."""
        import httpx

        while True:
            with self.lock:
                want = self.want
                if want is None or m.holds == want or m.state == "dead":
                    if want is not None and m.holds == want:
                        m.state = "ready"
                    m.loading = False
                    self.changed.notify_all()
                    return
                m.loading = True
            try:
                r = httpx.post(f"{m.url}/load", json={"policy": want[0], "digest": want[1]},
                               timeout=httpx.Timeout(self.cfg.generate.server_start_timeout, connect=10),
                               headers=bearer(self.token))
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            except Exception as e:  # noqa: BLE001 - the watch finds out whether it is dead
                print(f"replica {m.index}: loading {want[0]} failed: {e}", flush=True)
                with self.lock:
                    m.failures += 1
                    if m.failures >= 3:
                        m.state = "dead"
                    self.changed.notify_all()
                time.sleep(1.0)
                continue
            with self.lock:
                m.holds = want

    def _reload(self, m: RoutedReplica) -> None:
        """Have up member m load the wanted policy in a thread of its own, unless one is at it (the caller holds
        the lock). A member started while no policy was wanted (the streaming sampler's requests name their own)
        is up but holds none: it loads the one a session asks for like a ready one."""
        m.state = "loading"
        if not m.loading:
            m.loading = True
            threading.Thread(target=self._load, args=(m,), daemon=True).start()

    def lost(self, m: RoutedReplica, why: str, life: int | None = None) -> None:
        with self.lock:
            if m.state in ("dead", "starting") or (life is not None and life != m.life):
                return                    # (already known, or said of a start that has been replaced)
            m.state = "dead"
            for loop, call in m.calls:        # (a hung member never closes their connections: cut them here)
                loop.call_soon_threadsafe(call.cancel)
            self.changed.notify_all()
            self.lost_count += 1
        print(f"replica {m.index}: lost ({why})", flush=True)

    def watch(self) -> None:
        """Every second: a member whose process exited or that failed its health check twice is lost; a lost one
        is replaced."""
        import httpx

        while not self.stopping.wait(1.0):
            for m in list(self.members):
                if m.state in ("starting",):
                    continue
                if m.state == "dead":
                    if not m.starts.due():
                        continue              # (one that did not start: tried again after its backoff)
                    with self.lock:
                        m.state, m.replaced = "starting", m.replaced + 1
                        self.counts["replaced"] += 1
                    if m.proc is not None and m.proc.poll() is None:
                        m.proc.kill()
                    threading.Thread(target=self._start, args=(m,), daemon=True).start()
                    continue
                if m.proc is not None and m.proc.poll() is not None:
                    self.lost(m, how_it_ended(m.proc.returncode))
                    continue
                try:
                    httpx.get(f"{m.url}/health", timeout=10).raise_for_status()
                    m.health.answered()
                except Exception as e:  # noqa: BLE001
                    if m.health.failed(refused=isinstance(e, httpx.ConnectError)):
                        self.lost(m, f"health check: {e}")

    def stop_members(self) -> None:
        self.stopping.set()
        for m in self.members:
            self._stop(m.index, m.proc)

    def _stop(self, index: int, proc: subprocess.Popen | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.terminate()
        if self.launch and self.launch.get("stop"):
            run([a.replace("{i}", str(index)) for a in self.launch["stop"]], capture_output=True)

    # ------------------------------------------------------------------------------------------ the API

    def set_policy(self, policy: str, digest: str) -> dict:
        """Every member loads (policy, digest); returns once all are ready, or LATE_GRACE s after the first was
        (the others are late: used once they hold it), or the start timeout passed."""
        with self.lock:
            self.want = (policy, digest)
            for m in self.members:
                if m.state in ANSWERING and m.holds != self.want:
                    self._reload(m)
        deadline = time.monotonic() + self.cfg.generate.server_start_timeout
        first = None
        with self.lock:
            while True:
                ready = [m.index for m in self.members if m.state == "ready" and m.holds == self.want]
                if ready and first is None:
                    first = time.monotonic()
                if len(ready) == len(self.members) or (first and time.monotonic() - first > LATE_GRACE):
                    break
                if self.stopping.is_set():
                    raise RuntimeError("the generate router is stopping")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no replica holds {policy} after {self.cfg.generate.server_start_timeout} s")
                if self.launch is None and all(m.starts.given_up() for m in self.members):
                    raise RuntimeError(f"every replica failed to start {START_TRIES} times in a row (the same "
                                       f"command here each time), the last: {self.members[-1].starts.error}")
                self.changed.wait(0.5)
            return {"ready": ready, "late": [m.index for m in self.members if m.index not in ready]}

    def pick(self, key: str | None) -> RoutedReplica | None:
        with self.lock:
            ready = [m for m in self.members if m.state == "ready" and m.holds == self.want]
            if not ready:
                return None
            if key is not None and (i := self.sticky.get(key)) is not None and self.members[i] in ready:
                m = self.members[i]
                self.counts["sticky"] += 1
            else:
                m = least_loaded(ready, lambda x: (x.busy, x.routed, x.index))
                self.counts["new"] += 1
            if key is not None:
                self.sticky.remember(key, m.index)
            m.busy += 1
            m.routed += 1
            return m

    async def sample(self, body: dict) -> tuple[int, dict]:
        import httpx

        self.last_used = time.monotonic()
        if (body["policy"], body["digest"]) != self.want:
            return 409, {"error": f"the router serves {self.want}, not {body['policy']} ({body['digest']})"}
        deadline = time.monotonic() + self.cfg.generate.server_start_timeout
        attempt = 0
        while True:
            m = self.pick(body.get("key"))
            if m is None:
                if time.monotonic() > deadline or self.stopping.is_set():
                    return 503, {"error": "no replica is ready"}
                await asyncio.sleep(0.2)
                continue
            if attempt:
                self.counts["retried"] += 1
            attempt += 1
            life = m.life
            try:
                r = await self.forward(m, life, f"{m.url}/sample", body)
            except httpx.TransportError as e:
                self.lost(m, f"{type(e).__name__}: {e}", life)
                continue
            if r.status_code == 409:                  # it holds another version: loaded again, not used till then
                with self.lock:
                    m.holds = None
                    self._reload(m)
                continue
            if r.status_code != 200:
                return 502, {"error": f"replica {m.index}: HTTP {r.status_code}: {r.text[:500]}"}
            out = r.json()
            with self.lock:
                m.tokens += sum(len(s[1]) for s in out["samples"])
                m.seconds += out["sampling_seconds"]
            out["replica"] = m.index
            return 200, out

    async def forward(self, m: RoutedReplica, life: int, url: str, body: dict):
        """POST `body` to member m (its start `life`; m.busy raised by the caller, lowered here), cut off as a
        TransportError once m is said lost: one that hangs keeps its connections open (docs/internals.md)."""
        import httpx

        loop = asyncio.get_running_loop()
        call = asyncio.ensure_future(self._client().post(url, json=body, headers=bearer(self.token)))
        with self.lock:
            if m.life != life or m.state == "dead":
                call.cancel()
            m.calls.add((loop, call))
        try:
            return await call
        except asyncio.CancelledError:
            cancelling = getattr(asyncio.current_task(), "cancelling", lambda: 0)()      # (3.11+)
            if call.cancelled() and not cancelling and (m.life != life or m.state == "dead"):
                raise httpx.ReadError(f"replica {m.index} was lost while it answered") from None
            raise                                       # (this request's own caller went away)
        finally:
            with self.lock:
                m.calls.discard((loop, call))
                m.busy -= 1

    def _client(self):
        import httpx

        if self.client is None:          # (one client, its connections kept: made in the server's loop)
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10),
                                            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64))
        return self.client

    async def stream(self, index: int, op: str, body: dict) -> tuple[int, dict]:
        """The streaming sampler's request `op` (stream | interrupt) to member `index`, forwarded as it is; 503
        when that member is not up, or is lost on the way (its rows continue on the others)."""
        import httpx

        self.last_used = time.monotonic()
        if not 0 <= index < len(self.members) or op not in ("stream", "interrupt"):
            return 404, {"error": f"no replica {index} or no route {op}"}
        m = self.members[index]
        with self.lock:
            up, life, url = m.state in ANSWERING and m.url is not None, m.life, m.url
            m.busy += up
        if not up:
            return 503, {"error": f"replica {index} is {m.state}"}
        try:
            r = await self.forward(m, life, f"{url}/{op}", body)
        except httpx.TransportError as e:
            self.lost(m, f"{type(e).__name__}: {e}", life)
            return 503, {"error": f"replica {index} lost: {type(e).__name__}: {e}"}
        out = r.json() if r.headers.get("content-type", "").startswith("application/json") else {"error": r.text}
        if op == "stream" and r.status_code == 200:
            with self.lock:
                m.routed += 1
                m.tokens += sum(len(row[1]) for row in out["rows"])
        return r.status_code, out

    def stats(self) -> dict:
        with self.lock:
            return {"members": {str(m.index): {"state": m.state, "url": m.url, "policy": (m.holds or [None])[0],
                                               "routed": m.routed, "tokens": m.tokens, "seconds": m.seconds,
                                               "busy": m.busy, "replaced": m.replaced} for m in self.members},
                    "counts": dict(self.counts), "want": list(self.want) if self.want else None,
                    "replace_seconds": list(self.replace_seconds), "lost": self.lost_count}


def app(router: Router, state: Path | None, owner: int | None = None):
    import contextlib

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tasks.core.daemon import Watch, forget, leave

    async def health(request: Request):
        return JSONResponse({"replicas": len(router.members),
                             "ready": sum(m.state == "ready" for m in router.members)})

    async def stats(request: Request):
        return JSONResponse(router.stats())

    async def policy(request: Request):
        body = await request.json()
        router.last_used = time.monotonic()
        try:
            return JSONResponse(await run_in_threadpool(router.set_policy, body["policy"], body["digest"]))
        except RuntimeError as e:
            return JSONResponse({"error": str(e)}, status_code=503)

    async def sample(request: Request):
        code, out = await router.sample(await request.json())
        return JSONResponse(out, status_code=code)

    async def stream(request: Request):
        index, op = int(request.path_params["index"]), request.path_params["op"]
        code, out = await router.stream(index, op, await request.json())
        return JSONResponse(out, status_code=code)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        for m in router.members:
            threading.Thread(target=router._start, args=(m,), daemon=True).start()
        threading.Thread(target=router.watch, daemon=True).start()
        idle = router.cfg.generate.server_idle_timeout or None

        def watch() -> None:            # (`owner`: the process that started the fleet; it never outlives it)
            why = Watch(pid=os.getpid(), state=state, idle=idle, owner=owner,
                        unused=lambda: time.monotonic() - router.last_used).wait(2.0)
            print(f"router: leaving ({why})", flush=True)
            router.stop_members()
            leave(state, os.getpid())
        threading.Thread(target=watch, daemon=True).start()
        yield
        router.stop_members()
        forget(state, os.getpid())

    return Starlette(routes=[Route("/health", health), Route("/stats", stats),
                             Route("/policy", policy, methods=["POST"]), Route("/sample", sample, methods=["POST"]),
                             Route("/stream/{index:int}/{op:str}", stream, methods=["POST"])],
                     lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from tasks.core.config import Config

    ap = argparse.ArgumentParser(prog="python -m tasks.engines.replica_router",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--state", default=None)
    ap.add_argument("--owner", type=int, default=None, help="leave (replicas and all) once this process has ended")
    args = ap.parse_args(argv)
    with open(args.config_json) as f:
        cfg = Config.model_validate(json.load(f))
    launch = json.loads(os.environ[LAUNCH_VAR]) if os.environ.get(LAUNCH_VAR) else None
    router = Router(cfg, Path(args.config_json), launch)
    state = Path(args.state) if args.state else None

    class StoppingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            router.stopping.set()       # (a policy request waiting for replicas answers now: nothing holds the exit)
            super().handle_exit(sig, frame)

    # (uvicorn's own SIGTERM handling ends the app, its requests cut after STOP_GRACE s: the lifespan's exit stops
    # the replicas)
    StoppingServer(uvicorn.Config(app(router, state, args.owner), host="127.0.0.1", port=args.port,
                                  log_level="warning", access_log=False, lifespan="on",
                                  timeout_graceful_shutdown=STOP_GRACE)).run()
    return 0



if __name__ == "__main__":
    sys.exit(main())

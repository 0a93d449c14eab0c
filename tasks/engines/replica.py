"""A generate replica: one sampling engine (hf, vLLM offline or vLLM server: generate.engine / generate.mode) on
its own machine, serving the router (tasks/engines/replica_router.py) over HTTP. The model and its weights stay here;
only token ids travel.

    python -m tasks.engines.replica --config-json FILE [--host 0.0.0.0] [--port 8340] [--exit-with-parent]

The routes (JSON; every one but /health needs `Authorization: Bearer <RLFLOW_REPLICA_TOKEN>` when that is set):
    GET  /health                                {"policy", "digest", "busy", "served", "tokens", "seconds"}
    POST /load    {"policy", "digest"}          the policy the schedule names, loaded (whole or delta, from the
                                                store) and version-checked: its manifest's digest must be `digest`
    POST /sample  {"policy", "digest", "prompt_ids", "params"}     {"samples": [[prompt, ids, logprobs, trunc,
                                                                              versions]]}  (a Sample's fields)
    POST /stream, /interrupt                    generate.streaming's rows here (tasks/engines/replica_stream.py)
A /sample for another policy than the one held is refused (409): the router never takes a late replica's
tokens for the schedule's policy. It prints `RLFLOW_REPLICA_READY <url>` once it answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time

from tasks.core.fleet import authorized
from tasks.engines.replicas import READY, TOKEN_VAR, policy_digest


class Replica:
    """The engine and the one policy it holds; a lock makes one load or sample at a time."""

    def __init__(self, cfg):
        from tasks.engines.sampling import sampling_engine

        self.cfg, self.engine = cfg, sampling_engine(cfg)
        self.lock = threading.Lock()
        self.session = None
        self.policy = self.digest = None
        self.busy = self.served = self.tokens = 0
        self.seconds, self.used = 0.0, time.monotonic()
        self.stream_lock = threading.Lock()     # generate.streaming: the run's decoder and its rows here
        self.decoder, self.streams, self.interrupt = None, None, -1
        self.stream_session = None              # the sampler whose rows these are (not `session`: /load's)
        self.rows: dict = {}

    def _checked(self, policy: str, digest: str, asker: str) -> str:
        """The policy's folder, once the store's digest of it is `digest` (the version asked for)."""
        from tasks.core.models import policy_path

        found = policy_digest(self.cfg, policy)
        if found != digest:
            raise LookupError(f"the store's {policy} has digest {found}, {asker} asked for {digest}")
        return policy_path(self.cfg, policy)

    def load(self, policy: str, digest: str) -> dict:
        from tasks.core.models import load_tokenizer

        t0 = time.perf_counter()
        with self.lock:
            if (self.policy, self.digest) != (policy, digest):
                if self.session is not None:
                    self.session.close()
                self.session = self.policy = self.digest = None
                path = self._checked(policy, digest, "the router")
                self.session = self.engine.session(policy, path, load_tokenizer(path))
                self.policy, self.digest = policy, digest
        return {"policy": policy, "digest": digest, "seconds": time.perf_counter() - t0}

    def sample(self, body: dict) -> dict:
        from tasks.core.contracts import SamplingParams

        params = SamplingParams(**body["params"])
        self.busy += 1
        self.used = time.monotonic()
        try:
            with self.lock:
                if (self.policy, self.digest) != (body["policy"], body["digest"]):
                    raise LookupError(f"holds {self.policy} ({self.digest}), asked for {body['policy']} "
                                      f"({body['digest']})")
                sampled = self.session.sample(body["prompt_ids"], params)
                self.served += 1
                self.tokens += sum(len(s.completion_ids) for s in sampled.samples)
                self.seconds += sampled.sampling_seconds
        finally:
            self.busy -= 1
        return {"samples": [dataclasses.astuple(s) for s in sampled.samples],
                "load_seconds": sampled.load_seconds, "sampling_seconds": sampled.sampling_seconds}

    def stream(self, body: dict) -> dict:
        """The streaming sampler's request: its rows here dropped and added (each with its tokens so far and
        its own sampling settings, if any), its policy loaded in place if it is another (version-checked), then
        decoded by the run's decoder (tasks/engines/streaming.py: decoder_of) until a row finishes, `refill` rows
        have, or the request is interrupted; each row's new tokens and logprobs, and whether it is done."""
        from tasks.core.contracts import SamplingParams
        from tasks.engines.streaming import Row, decoder_of

        self.busy += 1
        self.used = time.monotonic()
        try:
            with self.stream_lock:
                want = (body["policy"], body["digest"])
                if self.decoder is None:
                    self.decoder = decoder_of(self.cfg, SamplingParams(**body["params"]))
                if self.streams != want:
                    self.decoder.load(want[0], self._checked(*want, "the sampler"))
                    self.streams = want
                if self.stream_session != body["session"]:   # (a new sampler: the rows of the last one dropped)
                    self.rows, self.stream_session = {}, body["session"]
                for rid in body["drop"]:
                    self.rows.pop(rid, None)
                for rid, prompt, tokens, limit, own in body["add"]:
                    self.rows[rid] = Row(rid, list(prompt), tokens=list(tokens), limit=limit, sampling=own)
                seq, refill = body["seq"], body["refill"]
                rows = list(self.rows.values())
                # (a row added part-way brings its tokens so far, not their logprobs: two offsets)
                before = {r.group: (len(r.tokens), len(r.logprobs)) for r in rows}
                if rows:
                    self.decoder.step_batch(rows, 0, lambda finished, n: finished >= refill or self.interrupt >= seq)
                out = []
                for r in rows:
                    k, lp = before[r.group]
                    if len(r.tokens) > k or r.done:
                        out.append([r.group, r.tokens[k:], r.logprobs[lp:], r.done, r.truncated])
                    if r.done:
                        del self.rows[r.group]
                self.tokens += sum(len(o[1]) for o in out)
                return {"rows": out}
        finally:
            self.busy -= 1

    def health(self) -> dict:
        return {"policy": self.policy, "digest": self.digest, "busy": self.busy, "served": self.served,
                "tokens": self.tokens, "seconds": self.seconds, "pid": os.getpid()}


def app(replica: Replica, token: str | None, parent: int | None, idle: float | None, on_ready=None):
    import contextlib

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from tasks.core.daemon import Watch, leave

    def denied(request: Request):
        if not authorized(request.headers, token):
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return None

    async def health(request: Request):
        return JSONResponse(replica.health())

    def answered(fn):
        """A route that runs fn(body) off the event loop: the token checked first, a version mismatch a 409."""
        async def route(request: Request):
            if (no := denied(request)) is not None:
                return no
            body = await request.json()
            try:
                return JSONResponse(await run_in_threadpool(fn, body))
            except LookupError as e:
                return JSONResponse({"error": str(e)}, status_code=409)
        return route

    load = answered(lambda body: replica.load(body["policy"], body["digest"]))
    sample, stream = answered(replica.sample), answered(replica.stream)

    async def interrupt(request: Request):
        if (no := denied(request)) is not None:
            return no
        replica.interrupt = max(replica.interrupt, int((await request.json())["seq"]))
        return JSONResponse({"seq": replica.interrupt})

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        def watch() -> None:            # the router that started it is gone, or nobody used it for a while
            Watch(parent=parent, idle=idle, unused=lambda: None if replica.busy else time.monotonic() - replica.used
                  ).wait(1.0)
            leave(code=0)
        threading.Thread(target=watch, daemon=True).start()
        if on_ready is not None:
            on_ready()
        yield

    return Starlette(routes=[Route("/health", health), Route("/load", load, methods=["POST"]),
                             Route("/sample", sample, methods=["POST"]), Route("/stream", stream, methods=["POST"]),
                             Route("/interrupt", interrupt, methods=["POST"])], lifespan=lifespan)


def main(argv: list[str] | None = None) -> int:
    from tasks.core.config import Config, load_config
    from tasks.core.errors import UserError, user_error_line
    from tasks.core.stage import parse_overrides_json, quiet_progress_bars

    ap = argparse.ArgumentParser(prog="python -m tasks.engines.replica", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-json", help="the run's config, resolved (the router writes it)")
    ap.add_argument("--config", help="or a config file (a replica on its own cluster: sky/replica.yaml)")
    ap.add_argument("--overrides-json", default="[]", metavar="JSON")
    ap.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to answer other machines (a cluster's port)")
    ap.add_argument("--port", type=int, default=0, help="0: a free one (printed on the READY line)")
    ap.add_argument("--exit-with-parent", action="store_true", help="leave when the process that started it ends")
    args = ap.parse_args(argv)
    quiet_progress_bars()
    try:
        if args.config_json:
            with open(args.config_json) as f:
                cfg = Config.model_validate(json.load(f))
        else:
            cfg = load_config(args.config, parse_overrides_json(args.overrides_json))
        cfg = cfg.model_copy(update={"generate": cfg.generate.model_copy(update={"replicas": 0})})
        if cfg.generate.replica_threads:
            import torch

            torch.set_num_threads(cfg.generate.replica_threads)
        replica = Replica(cfg)
    except UserError as e:
        print(user_error_line(e), file=sys.stderr, flush=True)
        return 2
    import uvicorn

    from tasks.core.serving import listening_socket

    sock, url = listening_socket(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(
        app(replica, os.environ.get(TOKEN_VAR) or None, os.getppid() if args.exit_with_parent else None,
            cfg.generate.server_idle_timeout or None, lambda: print(f"{READY} {url}", flush=True)),
        log_level="warning", access_log=False, lifespan="on"))
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generation replicas behind one router (generate.replicas: N): N sampling engines, each on a machine of its own
(tasks/engines/replica.py: a process here, or a SkyPilot cluster each), and one router in front that the generate
and evaluate stages sample through. The stages do not change: the router is one more SamplingEngine.

    stage ──► RoutedSession.sample ──► router (a daemon per run) ──► replica 0 | replica 1 | ... (HTTP, token ids)
    python -m tasks.engines.replica_router --config-json FILE --port P --state S     (ensure_router starts it)

Routes: GET /health, GET /stats, POST /policy {policy, digest}, POST /sample {policy, digest, prompt_ids,
params, key}, POST /stream/<i>/stream|interrupt (generate.streaming's, to replica i). The same rollouts whatever
N (fixed shards, each with its own seed); requests sticky by episode, new work to the least loaded replica; only
the schedule's policy (each replica version-checked); a failed replica (one that hangs too, once its probes fail)
is taken out, its requests cut off and sent again to the others, and it is replaced; the fleet leaves when the
process that started it has ended (--owner). Here the stage's side (the engine, its session, the router found or
started); the router itself, its members' lives and its HTTP front: tasks/engines/replica_router.py.
More: docs/internals.md (tasks/engines/replicas.py): each of these, and why a router of our own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core.contracts import Sample, Sampled, SamplingParams, SamplingSession
from tasks.core.hashing import digest
from tasks.core.paths import cache_root
from tasks.core.placement import REPLICA_LAUNCH_VAR

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import SamplingEngine

MARKER = "tasks.engines.replica"          # the router's and the local replicas' command lines carry it
LAUNCH_VAR = REPLICA_LAUNCH_VAR           # JSON {"start": argv, "port_base": n, "clusters": [name of i]}: the flow's
READY = "RLFLOW_REPLICA_READY"            # the line a replica prints once it answers: READY <url>
ANSWERING = ("loading", "ready")          # a member in these states is up (its /stream answers: streaming)
TOKEN_VAR = "RLFLOW_REPLICA_TOKEN"        # the router's token: only it may load policies into and sample replicas


def policy_digest(cfg: Config, policy: str) -> str:
    """What names a policy's exact weights: its store manifest's file digests (a delta policy's name its
    anchor's in its index file, so a rebuilt whole is checked too); the starting model's name for `base`."""
    from tasks.core import layout
    from tasks.core.store import open_store

    if policy == layout.BASE:
        return "base:" + digest(cfg.model.name_or_path)
    manifest = open_store(cfg).manifest(policy)
    if manifest is None:
        raise RuntimeError(f"policy {policy}: no complete folder in the store")
    return digest(manifest["files"])


def shard_seed(seed: int, shard: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/shard/{shard}".encode()).digest()[:7], "big")


def state_dir() -> Path:
    return cache_root() / "replicas"


# ------------------------------------------------------------------------------------------- the stage's side

class ReplicaEngine:
    """The SamplingEngine of generate.replicas >= 1: sessions sample through the run's router, started (with its
    replicas) by the first session on this machine and found again by the later ones, stopped by `stop`."""

    def __init__(self, cfg: Config, one: SamplingEngine, launch: Mapping | None = None):
        self.cfg, self.one, self.launch = cfg, one, launch       # (`one`: what each replica runs; `launch`: sky's)

    def check_installed(self, cfg: Config) -> None:
        """Local replicas run the configured engine on this machine: it must be installed here."""
        self.one.check_installed(cfg)

    def session(self, policy: str, path: str, tokenizer) -> RoutedSession:
        return RoutedSession(self.cfg, policy, tokenizer, ensure_router(self.cfg, self.launch))

    def stop(self, log=print) -> None:
        daemon = _daemon(self.cfg)
        try:
            if (state := daemon.read()) is not None:
                daemon.stop(state)
                log(f"stopped the generate router and replicas of run {self.cfg.run.name} (pid {state['pid']})")
        except Exception as e:   # teardown must not mask the flow's own outcome
            log(f"stopping the generate router of run {self.cfg.run.name} failed: {e}")


class RoutedSession(SamplingSession):
    """One policy on every replica (loaded and version-checked when the session opens); `sample` sends the
    prompts' shards through the router at once, each with its shard's seed."""

    def __init__(self, cfg: Config, policy: str, tokenizer, router: dict):
        import httpx

        self.cfg, self.policy, self.tokenizer = cfg, policy, tokenizer
        self.digest = policy_digest(cfg, policy)
        self.http = httpx.Client(base_url=router["url"], timeout=httpx.Timeout(None, connect=10),
                                 limits=httpx.Limits(max_connections=256))
        t0 = time.perf_counter()
        self.first = self._post("/policy", {"policy": policy, "digest": self.digest})
        self.load_seconds = time.perf_counter() - t0
        self.start_stats = self.stats()

    def _post(self, route: str, body: dict) -> dict:
        r = self.http.post(route, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"generate router {route}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def stats(self) -> dict:
        return self.http.get("/stats").json()

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams,
               keys: list[str] | None = None) -> Sampled:
        B = self.cfg.generate.batch_size
        bounds = [(lo, min(lo + B, len(prompt_ids))) for lo in range(0, len(prompt_ids), B)]
        t0 = time.perf_counter()

        def one(k: int) -> dict:
            lo, hi = bounds[k]
            shard = dataclasses.replace(params, seed=shard_seed(params.seed, k))
            return self._post("/sample", {"policy": self.policy, "digest": self.digest,
                                          "prompt_ids": prompt_ids[lo:hi], "params": dataclasses.asdict(shard),
                                          "key": keys[lo] if keys else None})

        with ThreadPoolExecutor(max_workers=max(min(len(bounds), 64), 1)) as pool:
            answers = list(pool.map(one, range(len(bounds))))
        samples = [Sample(lo + p, *rest)      # (each Sample's fields as the replica sent them, in order)
                   for (lo, _), a in zip(bounds, answers, strict=True) for p, *rest in a["samples"]]
        return Sampled(samples, load_seconds=sum(a["load_seconds"] for a in answers),
                       sampling_seconds=time.perf_counter() - t0)

    def metrics(self, prefix: str) -> dict[str, float]:
        """What the router did for this session: per replica its requests, tokens and tokens/s; the routing
        counts (sticky, new, retried) and replacements; and how many replicas the router has lost so far."""
        now, was = self.stats(), self.start_stats
        out = {}
        for i, m in now["members"].items():
            before = was["members"].get(i, {})
            tokens = m["tokens"] - before.get("tokens", 0)
            seconds = m["seconds"] - before.get("seconds", 0.0)
            out[f"{prefix}/replica{i}/requests"] = m["routed"] - before.get("routed", 0)
            out[f"{prefix}/replica{i}/tokens"] = tokens
            if seconds > 0:
                out[f"{prefix}/replica{i}/tokens_per_s"] = tokens / seconds
        for k in ("sticky", "new", "retried", "replaced"):
            out[f"{prefix}/router/{k}"] = now["counts"][k] - was["counts"][k]
        # replicas the router has lost since it started (between stages too: a session finds them replaced, so a
        # count per session read 0); the flow says each new one (flows/training.py: ConsoleWarnings.replicas)
        out[f"{prefix}/router/lost"] = float(now["lost"])
        return out

    def close(self) -> None:
        self.http.close()


def _daemon(cfg: Config):
    from tasks.core.daemon import Daemon

    return Daemon(state_dir() / f"{cfg.run.name}.json", MARKER, stop_wait=30.0)


def router_log(cfg: Config) -> Path:
    """The router's log: what it and its replicas print (why a replica was lost, its replacement's start)."""
    return _daemon(cfg).log


def ensure_router(cfg: Config, launch_spec: Mapping | None = None) -> dict:
    """The run's router on this machine (state: {pid, port, url, ...}), started with its replicas if none
    answers for this config; `launch_spec`: how it launches replica i on sky (the stage's context), None: a
    process here."""
    from tasks.core.daemon import answers_http
    from tasks.core.serving import free_port

    launch = json.dumps(dict(launch_spec)) if launch_spec is not None else ""
    blob = json.dumps(cfg.model_dump(mode="json"), sort_keys=True)
    key = digest([blob, launch, sys.executable])
    daemon = _daemon(cfg)

    def answers(state: dict) -> bool:
        return answers_http(f"{state['url']}/health", timeout=5)

    def start() -> dict:
        import secrets

        state_dir().mkdir(parents=True, exist_ok=True)
        config = state_dir() / f"{cfg.run.name}.config.json"
        config.write_text(blob)
        port = free_port()
        argv = [sys.executable, "-m", "tasks.engines.replica_router", "--config-json", str(config), "--port", str(port),
                "--state", str(daemon.path), "--owner", str(os.getpid())]    # (the fleet leaves when it ends)
        token = secrets.token_urlsafe(24)       # (the state file is its owner's only: Daemon.write)
        state = {"port": port, "key": key, "url": f"http://127.0.0.1:{port}", "token": token}
        return daemon.start(argv, {**os.environ, LAUNCH_VAR: launch, TOKEN_VAR: token, "PYTHONUNBUFFERED": "1"},
                            lambda s: s if answers(s) else None,
                            cfg.generate.server_start_timeout, "the generate router", state)

    return daemon.ensure(key, answers, start)

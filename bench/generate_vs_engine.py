"""Generate stage vs a bare call of the same engine on the same prompts, and server-mode weight reload vs a
fresh engine start.

    python bench/generate_vs_engine.py [--model builtin:small-lm] [--prompts 32] [--n 8] [--tokens 64]
                                       [--repeats 5] [--engines hf,vllm,server]

Both sides get the same prompt token ids (the stage's own data + tokenisation), the same seeds and sampling
settings, and load the model from disk:
- hf:     the generate stage (store, manifests, dataset, tokenisation, model load, our logprob-recording
          sampler) vs `AutoModelForCausalLM.from_pretrained` + `model.generate` in this process.
- vllm:   the generate stage in offline mode (it runs tasks/engines/vllm_worker.py under the vLLM environment's
          Python) vs a bare script in that environment: `vllm.LLM(same engine args)` + `LLM.generate`; the
          bare side's clock stops when its samples are printed (its interpreter teardown is not counted).
          Also compared: sampling alone (the worker's generate call vs the bare generate call).
- server: the generate stage with a warm server (policy already loaded) vs plain HTTP requests to the same
          server with the same bodies; the server's sampling vs the in-process engine's (warm); then the
          in-place reload of a new policy (weights written to the store as v1, v2, ...) vs starting the server
          and vs starting the offline engine.
tokens/s counts completion tokens (up to and including EOS). Stage and bare runs alternate; the ratios are
printed for the best run of each side (the one least disturbed by other load on a shared machine) and the median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench.work import keep_option, work_folder  # noqa: E402
from tasks.core import data, layout  # noqa: E402
from tasks.core.config import Config, load_config  # noqa: E402
from tasks.core.models import base_path, encode_prompt, load_tokenizer  # noqa: E402
from tasks.core.store import open_store  # noqa: E402
from tasks.engines.sampling import sampling_engine  # noqa: E402
from tasks.engines.vllm_offline import engine_args, request_seeds, worker_env  # noqa: E402
from tasks.generate import generate  # noqa: E402

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"

BARE_VLLM = r'''
import json, sys, time
t0 = time.perf_counter()
req = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    t1 = time.perf_counter()
    llm = LLM(**req["llm"])
    t2 = time.perf_counter()
    s = req["sampling"]
    params = [SamplingParams(n=s["n"], max_tokens=s["max_tokens"], temperature=s["temperature"], top_p=s["top_p"],
                             top_k=0, seed=seed, logprobs=0, stop_token_ids=s["stop_token_ids"], detokenize=False)
              for seed in req["seeds"]]
    prompts = [{"prompt_token_ids": p} for p in req["prompts"]]
    outs = llm.generate(prompts, params, use_tqdm=False)
    t3 = time.perf_counter()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print("BARE " + json.dumps({"import": t1 - t0, "engine": t2 - t1, "generate": t3 - t2, "tokens": tokens}),
          flush=True)
    t4 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)          # again, warm: what a long-lived server is
    print("WARM " + json.dumps({"generate": time.perf_counter() - t4}), flush=True)
'''


def stage_prompts(cfg: Config, iteration: int) -> tuple[list[list[int]], object]:
    """The prompt ids the generate stage builds for this iteration (same rows, same tokenisation)."""
    ds = data.load_prompts(cfg)
    P = cfg.generate.prompts_per_iteration
    rows = data.indices(len(ds), cfg.run.seed, data.cursor(iteration, P), P, cfg.data.shuffle)
    tok = load_tokenizer(base_path(cfg))
    return [encode_prompt(tok, data.prompt_of(cfg, ds[r]), cfg.generate.max_prompt_length) for r in rows], tok


def stage_run(cfg: Config, iteration: int, policy: str = layout.BASE) -> dict:
    t0 = time.perf_counter()
    m = generate(cfg, iteration, policy)["metrics"]
    wall = time.perf_counter() - t0
    tokens = round(m["generate/completion_length"] * cfg.generate.prompts_per_iteration * cfg.generate.num_generations)
    return {"wall": wall, "tokens": tokens, "sampling": tokens / m["generate/tokens_per_s"],
            "load": m["generate/load_seconds"]}


def bare_hf(cfg: Config, iteration: int) -> dict:
    """from_pretrained + model.generate with the same batches, seed and sampling settings."""
    from transformers import AutoModelForCausalLM

    gc = cfg.generate
    t0 = time.perf_counter()
    prompts, tok = stage_prompts(cfg, iteration)
    model = AutoModelForCausalLM.from_pretrained(base_path(cfg), dtype=torch.float32).eval()
    t1 = time.perf_counter()
    torch.manual_seed(cfg.run.seed * 1_000_003 + iteration)
    tokens = 0
    for start in range(0, len(prompts), gc.batch_size):
        chunk = prompts[start:start + gc.batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in chunk])
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=attn, do_sample=True, temperature=gc.temperature,
                                 top_p=gc.top_p, top_k=0, max_new_tokens=gc.max_completion_length,
                                 num_return_sequences=gc.num_generations, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        for row in out[:, L:].tolist():
            tokens += row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    t2 = time.perf_counter()
    return {"wall": t2 - t0, "tokens": tokens, "sampling": t2 - t1}


def bare_vllm(cfg: Config, iteration: int, work: Path) -> dict:
    """A plain vLLM script in the vLLM environment: same engine arguments, prompts, seeds, sampling."""
    gc = cfg.generate
    t0 = time.perf_counter()
    prompts, tok = stage_prompts(cfg, iteration)
    llm = engine_args(cfg, base_path(cfg))
    req = {"llm": llm, "prompts": prompts, "seeds": request_seeds(cfg.run.seed * 1_000_003 + iteration, len(prompts)),
           "sampling": {"n": gc.num_generations, "max_tokens": gc.max_completion_length, "temperature": gc.temperature,
                        "top_p": gc.top_p, "stop_token_ids": [tok.eos_token_id]}}
    (work / "bare.json").write_text(json.dumps(req))
    (work / "bare.py").write_text(BARE_VLLM)
    env = worker_env(**({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if llm.get("distributed_executor_backend") == "uni"
                        else {}))
    proc = subprocess.Popen([str(VLLM_PYTHON), str(work / "bare.py"), str(work / "bare.json")], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    result, warm = None, None
    for line in proc.stdout:
        if line.startswith("BARE "):
            result = json.loads(line[5:])
            wall = time.perf_counter() - t0          # samples in hand: the bare side's clock stops here
        elif line.startswith("WARM "):
            warm = json.loads(line[5:])["generate"]
            break
    proc.stdout.close()
    proc.wait()
    assert result is not None and warm is not None, "bare vLLM script failed"
    return {"wall": wall, "tokens": result["tokens"], "sampling": result["generate"], "load": result["engine"],
            "warm": warm}


def bare_http(cfg: Config, iteration: int) -> dict:
    """Plain HTTP to the run's server: one /v1/completions request per prompt, all in flight, the same bodies
    the stage sends (prompt ids, n, seeds, sampling settings, logprobs)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tasks.engines.vllm_server import SERVED, state_dir

    gc = cfg.generate
    t0 = time.perf_counter()
    prompts, tok = stage_prompts(cfg, iteration)
    seeds = request_seeds(cfg.run.seed * 1_000_003 + iteration, len(prompts))
    state = json.loads((state_dir() / f"{cfg.run.name}.json").read_text())
    client = httpx.Client(base_url=f"http://127.0.0.1:{state['port']}", timeout=None)
    model = state["adapter"] or SERVED

    def one(i: int) -> int:
        body = {"model": model, "prompt": prompts[i], "n": gc.num_generations, "max_tokens": gc.max_completion_length,
                "temperature": gc.temperature, "top_p": gc.top_p, "top_k": 0, "seed": seeds[i], "logprobs": 0,
                "return_token_ids": True, "stop_token_ids": [tok.eos_token_id]}
        return sum(len(c["token_ids"]) for c in client.post("/v1/completions", json=body).json()["choices"])

    t1 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    t2 = time.perf_counter()
    client.close()
    return {"wall": t2 - t0, "tokens": tokens, "sampling": t2 - t1}


def publish_copy(cfg: Config, version: int, seed: int) -> str:
    """A new full-weights policy in the store (the base model, perturbed): what publish would write."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_path(cfg))
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        load_tokenizer(base_path(cfg)).save_pretrained(tmp)
        key = layout.policy(cfg.run.name, version)
        open_store(cfg).put_folder(key, Path(tmp))
    return key


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def best(runs: list[dict], key: str) -> float:
    return min(r[key] for r in runs)


def report(name: str, stage: list[dict], bare: list[dict]) -> None:
    """tokens/s of each side and the ratio, for the best run (the least disturbed by other load on a shared
    machine) and the median run; then the same for sampling alone."""
    st, bt = med(stage, "tokens"), med(bare, "tokens")
    for label, stat in (("best", best), ("median", med)):
        s_rate, b_rate = st / stat(stage, "wall"), bt / stat(bare, "wall")
        s_samp, b_samp = st / stat(stage, "sampling"), bt / stat(bare, "sampling")
        print(f"{name} [{label}]: stage {stat(stage, 'wall'):.2f} s for {st:.0f} tokens = {s_rate:.0f} tok/s | bare "
              f"{stat(bare, 'wall'):.2f} s for {bt:.0f} tokens = {b_rate:.0f} tok/s | ratio {s_rate / b_rate:.3f}; "
              f"sampling alone {s_samp:.0f} vs {b_samp:.0f} tok/s, ratio {s_samp / b_samp:.3f}")
    print(f"{name} runs (s): stage {[round(r['wall'], 2) for r in stage]}  bare {[round(r['wall'], 2) for r in bare]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:small-lm")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="max_completion_length (a random model rarely stops)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--engines", default="hf,vllm,server")
    keep_option(ap)
    args = ap.parse_args()
    engines = args.engines.split(",")
    work = work_folder("rlflow-bench-gen-", args.keep)

    def cfg(name: str, *extra: str):
        return load_config(ROOT / "configs" / "tiny.yaml", [
            f"run.name={name}", f"store.uri={work}/store", f"model.name_or_path={args.model}",
            f"generate.prompts_per_iteration={args.prompts}", f"generate.num_generations={args.n}",
            f"generate.max_completion_length={args.tokens}", f"generate.vllm_python={VLLM_PYTHON}", *extra])

    print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    print(f"model {args.model}; {args.prompts} prompts x {args.n} samples x <= {args.tokens} tokens; "
          f"repeats {args.repeats}; load average {os.getloadavg()[0]:.2f}")

    if "hf" in engines:
        stage, bare = [], []
        stage_run(cfg("hf-warm"), 1), bare_hf(cfg("hf-warm"), 1)       # imports, file cache, torch kernels
        for r in range(args.repeats):
            stage.append(stage_run(cfg(f"hf-{r}"), 1))
            bare.append(bare_hf(cfg(f"hf-{r}"), 1))
        report("hf", stage, bare)

    offline_start = None
    if "vllm" in engines:
        stage, bare = [], []
        for r in range(args.repeats):
            stage.append(stage_run(cfg(f"vllm-{r}", "generate.engine=vllm"), 1))
            bare.append(bare_vllm(cfg(f"vllm-{r}", "generate.engine=vllm"), 1, work))
            assert stage[-1]["tokens"] == bare[-1]["tokens"], "same seeds: the same samples on both sides"
        report("vllm offline", stage, bare)
        offline_start, offline_wall = best(bare, "load"), best(stage, "wall")
        offline_tokens, offline_warm = med(bare, "tokens"), best(bare, "warm")
        print(f"vllm offline: engine start (LLM constructor) {offline_start:.1f} s; stage wall "
              f"{best(stage, 'wall'):.1f} s of which sampling {best(stage, 'sampling'):.1f} s (best runs)")

    if "server" in engines:
        c = cfg("server", "generate.engine=vllm", "generate.mode=resident")

        def stale(it: int, v: int):
            return cfg("server", "generate.engine=vllm", "generate.mode=resident", f"run.max_staleness={it - 1 - v}")

        try:
            first = stage_run(c, 1)                                     # starts the server (base model)
            warm, bare, reloads, it = [], [], [], 1
            for v in range(1, args.repeats + 1):
                key = publish_copy(c, v, seed=v)
                it += 1
                # (iteration `it` samples from v: the schedule's v(it-1-S) with S = it-1-v)
                reloads.append(stage_run(stale(it, v), it, key)["load"])   # loads v in place, then samples
                it += 1
                warm.append(stage_run(stale(it, v), it, key))           # same policy again: no reload
                bare.append(bare_http(c, it))                           # the same requests, plain HTTP
                assert warm[-1]["tokens"] == bare[-1]["tokens"], "same seeds: the same samples on both sides"
        finally:
            sampling_engine(c).stop()
        report("vllm server (warm) vs bare HTTP to the same server", warm, bare)
        if offline_start is not None:
            server_rate = med(warm, "tokens") / best(warm, "sampling")
            print(f"vllm server sampling vs the in-process engine's warm LLM.generate (bare vllm above): "
                  f"{server_rate:.0f} vs {offline_tokens / offline_warm:.0f} tok/s, ratio "
                  f"{server_rate / (offline_tokens / offline_warm):.3f}")
        reload_s, start_s = min(reloads), first["load"]
        print(f"server: fresh start (spawn -> /health, base loaded) {start_s:.1f} s; in-place reload of a new "
              f"policy (reload + prefix-cache reset + version check) {reload_s:.3f} s  "
              f"runs {[round(x, 3) for x in reloads]}")
        print(f"server: reload / fresh server start = {reload_s / start_s:.4f} ({start_s / reload_s:.0f}x faster)")
        if offline_start is not None:
            print(f"server: reload / offline engine start = {reload_s / offline_start:.4f} "
                  f"({offline_start / reload_s:.0f}x faster); generate stage wall: offline {offline_wall:.1f} s, "
                  f"server first (start) {first['wall']:.1f} s, server warm {best(warm, 'wall'):.2f} s (best runs)")


if __name__ == "__main__":
    main()

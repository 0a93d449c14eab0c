"""Generation replicas (generate.replicas, tasks/engines/replicas.py) against one, side by side on this machine:

  1. generate-stage throughput (completion tokens per second of sampling, the router's wall clock) with 1, 2 and
     3 CPU replicas of equal size, one torch thread each so that replicas do not share cores, against 1 replica
     (the rollouts are checked bit-identical on the way);
  2. the router's added latency per request: one token of one short prompt, straight to a replica vs through
     the router, one request at a time;
  3. the time to replace a replica: killed, until the router has it back holding the policy;
  4. prefix-friendly routing: letters episodes on 2 replicas, where each episode's turns went (sticky hits vs
     new episodes), and whether any episode's turns were split.

    python bench/replicas_vs_one.py [--model builtin:smollm2-135m] [--prompts 16] [--counts 1,2,3] [--calls 100]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tasks.core import layout  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.engines.replicas import ensure_router, policy_digest  # noqa: E402
from tasks.engines.sampling import sampling_engine  # noqa: E402
from tasks.generate import generate  # noqa: E402


def _cfg(tmp: Path, n: int, args, *more: str, config: Path = ROOT / "configs" / "tiny.yaml"):
    return load_config(config, [f"generate.replicas={n}", f"store.uri=file://{tmp}/store{n}",
                                "generate.replica_threads=1", f"tracking.uri=sqlite:///{tmp}/m.db", *more])


def throughput(tmp: Path, args) -> dict[int, dict]:
    more = [f"model.name_or_path={args.model}", f"generate.prompts_per_iteration={args.prompts}",
            "generate.num_generations=8", "generate.max_completion_length=32", "generate.batch_size=2",
            "generate.temperature=1.0"]
    out = {}
    for n in args.counts:
        cfg = _cfg(tmp, n, args, *more)
        try:
            m = generate(cfg, 1)["metrics"]
        finally:
            sampling_engine(cfg).stop(lambda _line: None)
        folder = tmp / f"store{n}" / layout.rollouts(cfg.run.name, 1)
        digest = hashlib.sha256((folder / "rollouts.jsonl").read_bytes()).hexdigest()[:12]
        out[n] = {"tokens_per_s": m["generate/tokens_per_s"], "sampling_s": m["generate/sampling_seconds"],
                  "rollouts": digest, "per_replica": [m.get(f"generate/replica{i}/requests") for i in range(n)]}
        print(f"  {n} replica(s): {out[n]['tokens_per_s']:.1f} tokens/s, sampling {out[n]['sampling_s']:.1f} s, "
              f"requests per replica {out[n]['per_replica']}, rollouts {digest}", flush=True)
    return out


def latency_and_replacement(tmp: Path, args) -> dict:
    cfg = _cfg(tmp, 1, args, "store.uri=file://" + str(tmp) + "/lat")
    router = ensure_router(cfg)
    try:
        http = httpx.Client(base_url=router["url"], timeout=600)
        digest = policy_digest(cfg, layout.BASE)
        http.post("/policy", json={"policy": layout.BASE, "digest": digest}).raise_for_status()
        stats = http.get("/stats").json()
        replica = stats["members"]["0"]["url"]
        body = {"policy": layout.BASE, "digest": digest, "prompt_ids": [[1, 2, 3]], "key": None,
                "params": {"n": 1, "max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "seed": 0}}
        direct_client = httpx.Client(base_url=replica, timeout=600)

        def timed(fn) -> float:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        headers = {"authorization": f"Bearer {router['token']}"}    # (the run's state file holds it)
        for _ in range(10):                                       # warm both paths
            direct_client.post("/sample", json=body, headers=headers).raise_for_status()
            http.post("/sample", json=body).raise_for_status()
        direct = [timed(lambda: direct_client.post("/sample", json=body, headers=headers).raise_for_status())
                  for _ in range(args.calls)]
        routed = [timed(lambda: http.post("/sample", json=body).raise_for_status()) for _ in range(args.calls)]
        pid = httpx.get(f"{replica}/health").json()["pid"]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while True:
            s = http.get("/stats").json()
            if s["counts"]["replaced"] and s["members"]["0"]["state"] == "ready":
                break
            time.sleep(0.05)
        return {"direct_ms": 1000 * statistics.median(direct), "routed_ms": 1000 * statistics.median(routed),
                "replace_s": time.perf_counter() - t0, "replica_start_s": s["replace_seconds"][-1]}
    finally:
        sampling_engine(cfg).stop(lambda _line: None)


def episodes(tmp: Path, args) -> dict:
    cfg = _cfg(tmp, 2, args, "generate.prompts_per_iteration=8", "generate.num_generations=4",
               "generate.batch_size=1", f"store.uri=file://{tmp}/ep", config=ROOT / "configs" / "letters.yaml")
    try:
        m = generate(cfg, 1)["metrics"]
    finally:
        sampling_engine(cfg).stop(lambda _line: None)
    return {k.split("/")[-1] if "router" in k else k.split("generate/")[-1]: v for k, v in m.items()
            if "router" in k or k.endswith("/requests")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--counts", default="1,2,3")
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    args.counts = [int(c) for c in args.counts.split(",")]
    os.environ.setdefault("RLFLOW_CACHE", str(Path(tempfile.gettempdir()) / "rlflow-bench-cache"))
    with tempfile.TemporaryDirectory(prefix="rlflow-bench-replicas-") as tmp:
        tmp = Path(tmp)
        print(f"1. generate-stage throughput, {args.model}, {args.prompts} prompts x 8 x 32 tokens, shards of 2:")
        t = throughput(tmp, args)
        one = t[args.counts[0]]["tokens_per_s"]
        same = len({v["rollouts"] for v in t.values()}) == 1
        for n, v in t.items():
            print(f"   {n} replica(s) vs 1: {v['tokens_per_s'] / one:.2f}x")
        print(f"   rollouts identical across counts: {same}")
        print("2./3. router latency and replica replacement (builtin tiny model):")
        lat = latency_and_replacement(tmp, args)
        print(f"   one-token request: direct {lat['direct_ms']:.2f} ms, through the router {lat['routed_ms']:.2f} ms "
              f"(+{lat['routed_ms'] - lat['direct_ms']:.2f} ms); replacement after a kill {lat['replace_s']:.1f} s "
              f"(a new replica process up and holding the policy: {lat['replica_start_s']:.1f} s)")
        print("4. letters episodes (8 x 4, up to 4 turns) on 2 replicas:")
        print("   " + json.dumps(episodes(tmp, args)))


if __name__ == "__main__":
    main()

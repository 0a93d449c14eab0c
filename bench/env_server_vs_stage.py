"""Episodes per second with the environments in the stage (env.where: stage) and on an environment server
(env.where: local: tasks/envs/runtime/server.py over HTTP on this machine), side by side in one process: the letters
game (3 turns, one token a turn), a scripted engine (no model time), so what differs is the hop alone.

    python bench/env_server_vs_stage.py [--episodes 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flows.services import EnvServer  # noqa: E402
from tasks.core import builtin_models  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.contracts import Sample, Sampled, SamplingParams  # noqa: E402
from tasks.core.models import load_tokenizer  # noqa: E402
from tasks.envs.runtime.episodes import run_episodes  # noqa: E402

LETTERS = ROOT / "configs" / "letters.yaml"


class Echo:
    """A sampling session that says the letter the last observation named: no model time, every episode scores 1."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def sample(self, prompt_ids, params, keys=None):
        tokenizer, out = self.tokenizer, []
        for i, ids in enumerate(prompt_ids):
            text = tokenizer.decode(ids[-12:])
            letter = next((c for c in reversed(text) if c in "abcd"), "a")
            out.append(Sample(i, tokenizer(letter, add_special_tokens=False)["input_ids"], [-0.1], truncated=False))
        return Sampled(out, 0.0, 0.0)


def episodes_per_second(cfg, rows, tok, n: int, services=None) -> float:
    t0 = time.perf_counter()
    records = run_episodes(cfg, dict(enumerate(rows)), list(range(len(rows))), Echo(tok),
                           SamplingParams(n=n, max_new_tokens=1, temperature=1.0, top_p=1.0, seed=1), services)[0]
    seconds = time.perf_counter() - t0
    assert all(r.env_error is None for r in records), [r.env_error for r in records if r.env_error][:3]
    return len(records) / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = load_tokenizer(builtin_models.resolve("builtin:tiny-lm"))
    rows = [{"prompt": "Say each letter I name.", "letters": "abcd"[i % 4] + "dcba"[i % 3] + "bd"[i % 2]}
            for i in range(args.episodes // 8)]
    results = {}
    for where in ("stage", "local"):
        overrides = [f"env.where={where}", "env.isolation=thread", "env.concurrency=64"]
        cfg = load_config(LETTERS, overrides)
        server = services = None
        if where == "local":
            server = EnvServer(cfg, str(LETTERS), overrides, None)
            services = server.services(lambda line: None)
        try:
            episodes_per_second(cfg, rows[:2], tok, 8, services)       # warm: imports, the first connection
            results[where] = max(episodes_per_second(cfg, rows, tok, 8, services) for _ in range(args.repeats))
        finally:
            if server is not None:
                server.stop()
    calls = 5                                   # per episode: open, reset, 3 steps (+ close)
    print(f"{'where':<8} {'episodes/s':>11} {'vs stage':>9}")
    for where, eps in results.items():
        print(f"{where:<8} {eps:>11.1f} {eps / results['stage']:>8.2f}x")
    extra = (1 / results["local"] - 1 / results["stage"]) / (calls + 1) * 1000
    print(f"the hop: ~{extra:.2f} ms per environment call ({calls + 1} calls an episode, "
          f"{args.episodes} episodes, best of {args.repeats})")


if __name__ == "__main__":
    main()

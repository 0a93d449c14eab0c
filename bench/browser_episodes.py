"""Browser episodes per second: the shop's tasks (tasks/envs/builtin/webshop.py) solved by its reference policy through
rlflow's episode loop (tasks/envs/runtime/episodes.py: tokens in and out, the chat template's rendering, a thread per
call), with the environment in the stage's process and in a process per episode, versus the same environment
driven alone by asyncio (no episode loop: the floor that Chromium and the environment set).

    python bench/browser_episodes.py [--rounds 3] [--concurrency 8]

Every episode must score 1 (the policy solves every task), or the benchmark stops. Prints episodes/s, turns/s
and the ratios to the bare environment (medians of interleaved rounds). Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.core import builtin_models  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.contracts import Sample, Sampled, SamplingParams  # noqa: E402
from tasks.core.models import load_tokenizer  # noqa: E402
from tasks.envs.builtin.browser import Browser  # noqa: E402
from tasks.envs.builtin.webshop import reference_action, serve, shop_tasks  # noqa: E402
from tasks.envs.runtime.episodes import run_episodes  # noqa: E402

MAX_TURNS = 12


class Policy:
    """A sampling session whose every completion is the reference policy's next action, as token ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def sample(self, prompt_ids, params: SamplingParams, keys=None) -> Sampled:
        tokenizer, out = self.tokenizer, []
        for i, ids in enumerate(prompt_ids):
            toks = tokenizer(reference_action(tokenizer.decode(ids)), add_special_tokens=False)["input_ids"]
            out.append(Sample(i, toks + [tokenizer.eos_token_id], [0.0] * (len(toks) + 1), truncated=False))
        return Sampled(out, 0.0, 0.0)


def through_episodes(url: str, rows: list[dict], isolation: str, concurrency: int, tok) -> tuple[int, float]:
    cfg = load_config(ROOT / "configs" / "browser.yaml", [
        "model.name_or_path=builtin:tiny-lm", f"env.kwargs.base_url={url}", f"env.isolation={isolation}",
        f"env.concurrency={concurrency}", "env.max_tokens=60000", "generate.max_prompt_length=60000",
        f"env.max_turns={MAX_TURNS}"])
    table = dict(enumerate(rows))
    start = time.perf_counter()
    records, _ = run_episodes(cfg, table, list(table), Policy(tok),
                              SamplingParams(n=1, max_new_tokens=200, temperature=1.0, top_p=1.0, seed=0))
    seconds = time.perf_counter() - start
    bad = [(r.env_return, r.env_error) for r in records if r.env_return != 1.0]
    assert not bad, bad[:3]
    return sum(sum(m["role"] == "assistant" for m in r.turns) for r in records), seconds


def bare(url: str, rows: list[dict], concurrency: int) -> tuple[int, float]:
    """The environment alone: reset, then the policy's action and a step, turn by turn, `concurrency` at once."""
    async def episode(row: dict, slots: asyncio.Semaphore) -> int:
        async with slots:
            env = Browser(url)
            context = (await env.reset(row))[0]["content"]
            turns = 0
            while turns < MAX_TURNS:
                turns += 1
                step = await env.step({"role": "assistant", "content": reference_action(context)})
                if step.done:
                    break
                context += step.observation[-1]["content"]
            await env.close()
            assert step.reward == 1.0, (row, env.checks)
            return turns

    async def all_of_them() -> int:
        slots = asyncio.Semaphore(concurrency)
        return sum(await asyncio.gather(*(episode(r, slots) for r in rows)))

    start = time.perf_counter()
    turns = asyncio.run(all_of_them())
    return turns, time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    rows = shop_tasks()
    tok = load_tokenizer(builtin_models.resolve("builtin:tiny-lm"))
    print(f"{platform.node()} {os.cpu_count()} cores; {len(rows)} tasks a round, concurrency {args.concurrency}")
    rates: dict[str, list[float]] = {"bare environment": [], "episodes, thread": [], "episodes, process": []}
    turns_per_s: dict[str, list[float]] = {k: [] for k in rates}
    with serve() as url:
        for r in range(args.rounds):
            for name, run in (
                    ("bare environment", lambda: bare(url, rows, args.concurrency)),
                    ("episodes, thread", lambda: through_episodes(url, rows, "thread", args.concurrency, tok)),
                    ("episodes, process", lambda: through_episodes(url, rows, "process", args.concurrency, tok))):
                turns, seconds = run()
                rates[name].append(len(rows) / seconds)
                turns_per_s[name].append(turns / seconds)
                print(f"round {r + 1}: {name:18s} {len(rows) / seconds:6.2f} episodes/s {turns / seconds:6.1f} turns/s "
                      f"({seconds:.1f} s)", flush=True)
    floor = statistics.median(rates["bare environment"])
    print("\nmedians:")
    for name in rates:
        eps = statistics.median(rates[name])
        print(f"  {name:18s} {eps:6.2f} episodes/s  {statistics.median(turns_per_s[name]):6.1f} turns/s  "
              f"{eps / floor:5.2f}x the bare environment")
    return 0


if __name__ == "__main__":
    sys.exit(main())

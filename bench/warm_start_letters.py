"""The warm start on the letters game (configs/letters.yaml): held-out greedy accuracy of the base model, of v0 after
SFT on demonstrations recorded by the game's reference policy, and after RL from each, over seeds.

    .venv/bin/python bench/warm_start_letters.py [--seeds 0 1 2] [--iterations 20] [--demos 40]

The 64 rows are every three-letter sequence of a-d, once each, in an order fixed by `--order-seed`: the first
`--demos` are the training prompts (and the recorded demonstrations' rows), the rest are held out (sequences
never seen in training; checked). (Until 2026-12-06 the rows were configs/data/letters.jsonl's, which repeats
sequences: 12 of the 24 "held-out" rows were training sequences.) Each arm is a real
`rlflow run` (eval.baseline: the starting policy's held-out score is the "start" column; eval at the last
iteration the "after RL" one): greedy accuracy, the share of held-out sequences whose greedy episode says every
letter back right (eval/greedy_pass_at_1). Always saying one letter passes a sequence of that letter alone (4 of
64); the format (one letter a turn) earns nothing of its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LETTERS = ROOT / "configs" / "letters.yaml"
sys.path.insert(0, str(ROOT))

from bench.work import keep_option, work_folder  # noqa: E402


def rlflow(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        raise SystemExit(f"rlflow {args[0]} failed:\n{out.stderr[-3000:]}")
    return out


def compare_arms(recipe: Path, common: list[str], arms: dict[str, list[str]], seeds: list[int], iterations: int,
                 work: Path) -> None:
    """Each arm (its name -> its own overrides) a real `rlflow run` of `recipe` per seed, after `common`; prints
    a line per run (its starting policy's held-out score, eval.baseline, and its last iteration's) and the means.
    (bench/shop_learning.py runs its arms through it too.)"""
    print(f"{'seed':>4}  {'arm':<10} {'start':>6} {'after RL':>9} {'seconds':>8}")
    table: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
    for seed in seeds:
        for arm, more in arms.items():
            name = f"{arm.split()[0]}-s{seed}"
            t = time.perf_counter()
            rlflow(["run", str(recipe), *common, *more, "-o", f"run.name={name}", "-o", f"run.seed={seed}",
                    "--summary-json", str(work / f"{name}.json")], work)
            held = json.loads((work / f"{name}.json").read_text())["held_out"]
            start, end = held["0"], held[str(iterations)]
            table[arm].append((start, end))
            print(f"{seed:>4}  {arm:<10} {start:6.3f} {end:9.3f} {time.perf_counter() - t:8.0f}", flush=True)
    for arm, rows in table.items():
        n = len(rows)
        print(f"mean  {arm:<10} {sum(a for a, _ in rows) / n:6.3f} {sum(b for _, b in rows) / n:9.3f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--demos", type=int, default=40)
    ap.add_argument("--rl-lr", type=float, help="train.lr of the RL after the warm start (default: the config's, "
                    "5e-3, tuned for the random base)")
    ap.add_argument("--arms", nargs="+", default=["base", "warm start"], choices=["base", "warm start"])
    ap.add_argument("--order-seed", type=int, default=0, help="the order of the 64 sequences (which are held out)")
    keep_option(ap)
    args = ap.parse_args()
    work = work_folder("rlflow-warm-", args.keep)
    prompt = json.loads((ROOT / "configs" / "data" / "letters.jsonl").read_text().splitlines()[0])["prompt"]
    rows = [{"prompt": prompt, "letters": "".join(s)} for s in itertools.product("abcd", repeat=3)]
    random.Random(args.order_seed).shuffle(rows)
    seen = {r["letters"] for r in rows[:args.demos]}
    assert not any(r["letters"] in seen for r in rows[args.demos:]), "a held-out sequence is a training one"
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:args.demos]))
    (work / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[args.demos:]))
    common = ["-o", f"data.path={work / 'train.jsonl'}", "-o", f"eval.path={work / 'held.jsonl'}",
              "-o", f"eval.every={args.iterations}", "-o", "eval.baseline=true", "-o", "eval.split=train",
              "-o", "eval.greedy=true", "-o", "eval.num_generations=1", "-o", "eval.metric=greedy_pass_at_1",
              "-o", f"run.iterations={args.iterations}", "-o", "env.isolation=thread"]
    rlflow(["record", str(LETTERS), "--policy", "tasks.envs.builtin.games:reference_action", "--out",
            str(work / "demos.jsonl"), *common], work)
    warmup = (f"warmup={{path: {work / 'demos.jsonl'}, epochs: 16, batch_size: 8, micro_batch_size: 8, "
              f"lr: 3.0e-3, lr_schedule: constant}}")
    lr = ["-o", f"train.lr={args.rl_lr}"] if args.rl_lr else []
    every = {"base": [], "warm start": ["-o", warmup, *lr]}
    print(f"letters game, {len(rows) - args.demos} held-out sequences, {args.iterations} RL iterations "
          f"(16 prompts x 8 episodes each); held-out greedy accuracy")
    compare_arms(LETTERS, common, {arm: every[arm] for arm in args.arms}, args.seeds, args.iterations, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Generation that never waits, measured: the same run with one stage after another (S=0), whole stages
overlapped (S=1) and the streaming sampler (generate.streaming, S=1, both on_update policies), side by side on
this machine, on a task whose completion lengths have a long tail.

    python bench/streaming_vs_stages.py [--iterations 8] [--modes s0 s1 interrupt finish] [-o key=value]...
                                        [--config configs/letters.yaml --episodes]   (multi-turn episodes)
                                        [--config configs/letters.yaml --step-seconds 0.05]  (a slow environment)

The recipe is configs/smollm2-arith.yaml (SmolLM2-135M-Instruct, hf engine, every stage inline, the resident
trainer) with completions of up to 96 tokens at temperature 1.0: most answers are a few tokens, some ramble to
the limit (the distribution is printed: median, 90th percentile, share at the limit). Each mode is a fresh
process running the Prefect flow on the same prompts for the same number of iterations (equal compute: every
sampled token is trained on in each mode), with the held-out evaluation (greedy, 100 questions never trained
on) of the base model and every --eval-every iterations. Printed per mode: the loop's wall time (the sum of
iteration/seconds less the evaluations), useful tokens/s (completion tokens trained / that time) and its ratio
to S=1, the sampler's and the trainer's busy shares of it, the streaming sampler's refills and interruptions,
and held-out greedy accuracy at the loop time when each evaluated policy's iteration ended (the base model's
once, in the first mode: the same seeded evaluation in every mode). `--episodes`: the config's rollouts are
multi-turn episodes (SmolLM2 in configs/letters.yaml's game: EPISODES's settings); a useful token is a model
token (mask 1), a length is an episode's model tokens.
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
CONFIG = ROOT / "configs" / "smollm2-arith.yaml"
MODES = {"s0": ["run.max_staleness=0"], "s1": ["run.max_staleness=1"],
         "interrupt": ["run.max_staleness=1", "generate.streaming.on_update=interrupt"],
         "finish": ["run.max_staleness=1", "generate.streaming.on_update=finish"]}
# --episodes: SmolLM2 plays the letters game (3 turns an episode, each turn up to --limit tokens at temperature 1.0),
# the recipe's learning rate, room in the context for three long turns, a held-out set of the game's rows
EPISODES = ["model.name_or_path=builtin:smollm2-135m", "train.lr=1e-5", "train.micro_batch_size=8",
            "env.max_tokens=800", "generate.prompts_per_iteration=8", "generate.num_generations=8"]


class SlowLetters:
    """configs/letters.yaml's game whose every step takes `seconds` (an environment that does real work: a browser
    page, a tool's call), for --step-seconds."""

    tools: list = []

    def __init__(self, seconds: float = 0.0):
        from tasks.envs.builtin.games import SayTheLetters

        self.game, self.seconds = SayTheLetters(), seconds

    def reset(self, row: dict) -> list[dict]:
        return self.game.reset(row)

    def step(self, message: dict):
        time.sleep(self.seconds)
        return self.game.step(message)


def overrides(args, work: Path, mode: str) -> list[str]:
    slow = [] if args.step_seconds is None else ["env.factory=bench.streaming_vs_stages:SlowLetters",
                                                 f"env.kwargs={{seconds: {args.step_seconds}}}"]
    return [f"run.name=stream-{mode}", f"run.iterations={args.iterations}", f"store.uri={work}/store",
            f"tracking.uri=sqlite:///{work}/mlflow.db", f"eval.every={args.eval_every}",
            "tracking.dashboard_every=0", "publish.register_model=false",
            f"generate.max_completion_length={args.limit}", "generate.temperature=1.0",
            *(EPISODES if args.episodes else []), *slow, *MODES[mode], *args.override]


def one(args) -> None:
    """Run one mode's flow here and print what it measured as one JSON line."""
    from mlflow.tracking import MlflowClient

    from flows.training import train_flow
    from tasks.core import layout, rollout
    from tasks.core.config import load_config
    from tasks.core.store import open_store

    work = Path(args.work)
    ov = overrides(args, work, args.one)
    cfg = load_config(args.config, ov)
    t0 = time.time()
    summary = train_flow(str(args.config), ov)
    wall = time.time() - t0
    client = MlflowClient(cfg.tracking.uri)

    def series(metric: str) -> list:
        return sorted(client.get_metric_history(summary["mlflow_run_id"], metric), key=lambda m: m.step)

    evals = {m.step: m.value for m in series("time/evaluate_seconds")}
    store = open_store(cfg)
    lengths = [sum(r.mask) if r.mask else len(r.completion_ids) for it in range(1, args.iterations + 1)
               for r in rollout.load(store, layout.rollouts(cfg.run.name, it))]
    # the loop's time: iteration after iteration (iteration/seconds: between two iterations' ends), evaluations
    # left out; vN's accuracy is plotted at the loop time when iteration N ended
    ends, at = {}, 0.0
    for m in series("iteration/seconds"):
        at += m.value - evals.get(m.step, 0.0)
        ends[m.step] = at
    acc = [(m.step, round(ends.get(m.step, 0.0), 1), m.value) for m in series("eval/greedy_pass_at_1")]
    print(json.dumps({
        "wall": at, "flow_wall": wall, "tokens": sum(lengths), "lengths": lengths,
        "sampling": sum(m.value for m in series("generate/sampling_seconds")),
        "train": sum(m.value for m in series("train/update_seconds")),
        "refills": sum(m.value for m in series("generate/refills")),
        "interruptions": sum(m.value for m in series("generate/interruptions")),
        "discarded": max([m.value for m in series("generate/discarded_tokens")], default=0.0),
        "accuracy": acc}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=8)
    ap.add_argument("--config", type=Path, default=CONFIG)
    ap.add_argument("--episodes", action="store_true", help="the config's rollouts are episodes (EPISODES)")
    ap.add_argument("--limit", type=int, default=96, help="generate.max_completion_length (an episode's: a turn's)")
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--step-seconds", type=float, help="the letters game with every step taking this long "
                    "(SlowLetters; with --config configs/letters.yaml)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--one", choices=list(MODES), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one(args)
    print(f"machine: {platform.node()} ({platform.machine()}), {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.config.name}; {args.iterations} iterations; overrides "
          f"{args.override}", flush=True)
    rows = {}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix="rlflow-stream-bench-") as work:
            baseline = [] if mode == args.modes[0] else ["eval.baseline=false"]    # (the same v0 in each mode)
            cmd = [sys.executable, __file__, "--one", mode, "--work", work, "--iterations", str(args.iterations),
                   "--eval-every", str(args.eval_every), "--config", str(args.config), "--limit", str(args.limit),
                   *(["--episodes"] if args.episodes else []),
                   *(["--step-seconds", str(args.step_seconds)] if args.step_seconds is not None else []),
                   *[a for o in [*baseline, *args.override] for a in ("-o", o)]]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if out.returncode != 0:
                raise SystemExit(f"{mode}: exit {out.returncode}\n{out.stderr[-3000:]}")
            rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{mode}: {json.dumps({k: v for k, v in rows[mode].items() if k != 'lengths'})}", flush=True)
    lengths = sorted(v for r in rows.values() for v in r["lengths"])
    limit = args.limit * (3 if args.episodes else 1)      # (the letters game: 3 turns)
    print(f"\ncompletion lengths (all modes, {len(lengths)} completions): median {statistics.median(lengths):.0f}, "
          f"90th percentile {lengths[int(0.9 * (len(lengths) - 1))]}, at the limit ({limit}) "
          f"{sum(v >= limit for v in lengths) / len(lengths):.1%}")
    ref = rows.get("s1")
    print("\n| mode | loop wall s | useful tokens/s | vs S=1 | sampler busy | trainer busy | refills | "
          "interruptions | discarded | held-out greedy accuracy (vN @ loop s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for mode, r in rows.items():
        tps = r["tokens"] / r["wall"]
        ratio = f"{tps / (ref['tokens'] / ref['wall']):.2f}x" if ref else "-"
        acc = ", ".join(f"v{s} {a:.2f} @ {t:.0f}" for s, t, a in r["accuracy"])
        print(f"| {mode} | {r['wall']:.0f} | {tps:.1f} | {ratio} | {r['sampling'] / r['wall']:.0%} | "
              f"{r['train'] / r['wall']:.0%} | {r['refills']:.0f} | {r['interruptions']:.0f} | "
              f"{r['discarded']:.0f} | {acc} |")


if __name__ == "__main__":
    main()

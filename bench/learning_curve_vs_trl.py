"""Learning curve on the demo task: our pipeline (the four stage functions, in a loop, on a local store)
against TRL's GRPOTrainer.train(), with equal hyper-parameters and seeds, both on this machine in one run.

    python bench/learning_curve_vs_trl.py [--iterations 60] [--seeds 0 1 2 3 4] [--out docs/benchmarks]
    python bench/learning_curve_vs_trl.py --staleness 0 1 --seeds 0 1 2     # run.max_staleness 0 and 1 vs TRL

Equal on both sides: the tiny model (same initial weights), the data (configs/data/successor.jsonl), the
reward function (tasks.rewards.demo:successor_reward — TRL calls it with the `answer` column too), 16
prompts x 8 generations per step, completions <= 4 tokens, temperature 1, AdamW lr 5e-3 constant, betas
(0.9, 0.999), no weight decay, grad-norm clip 1.0, loss dapo, beta 0, scale_rewards group, one optimiser
step per generated batch. The seeds drive sampling and data order on each side; the random streams differ,
so the comparison is between curves (mean over seeds), not step by step. With --staleness S > 0 our loop
runs as the flow schedules it: generate and reward of iterations N+1..N+S on a thread while N trains, each
iteration sampling from v(N-1-S).

Writes <out>/learning_curve_vs_trl.png and .csv (with --staleness: learning_curve_staleness_vs_trl.*) and
prints the table recorded in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.work import keep_option, work_folder  # noqa: E402
from tasks.core import layout  # noqa: E402
from tasks.core.builtin_models import resolve  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.generate import generate  # noqa: E402
from tasks.publish import publish  # noqa: E402
from tasks.reward import reward  # noqa: E402
from tasks.rewards.demo import successor_reward  # noqa: E402
from tasks.train import finish_trainer, train  # noqa: E402

CONFIG = ROOT / "configs" / "tiny.yaml"


def ours(iterations: int, seed: int, work: Path, mode: str = "auto", staleness: int = 0,
         extra: tuple[str, ...] = ()) -> tuple[list[float], list[float]]:
    """Rewards per iteration, and the seconds since the start at which each was known."""
    cfg = load_config(CONFIG, [f"run.name=curve-{seed}-s{staleness}", f"run.seed={seed}",
                               f"run.iterations={iterations}", f"run.max_staleness={staleness}",
                               f"store.uri={work}/store-{seed}-{mode}-s{staleness}", "eval.every=0",
                               "train.device=cpu", "publish.register_model=false", f"train.mode={mode}", *extra])

    def generate_and_score(it: int) -> float:
        generate(cfg, it, layout.behaviour_policy(cfg.run.name, it, staleness))
        return reward(cfg, it)["metrics"]["reward/mean"]

    out, when, t0 = [], [], time.perf_counter()
    ahead: dict = {}
    with ThreadPoolExecutor(max_workers=1) as lane:    # one after another, up to S iterations ahead of train
        for it in range(1, iterations + 1):
            for m in range(it, min(it + staleness, iterations) + 1):
                if m not in ahead:
                    ahead[m] = lane.submit(generate_and_score, m)
            out.append(ahead.pop(it).result())
            when.append(time.perf_counter() - t0)
            train(cfg, it)
            publish(cfg, it)
    finish_trainer(cfg)                               # a resident trainer: its last checkpoint, then it stops
    return out, when


def trl(iterations: int, seed: int, work: Path) -> tuple[list[float], list[float]]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cfg = load_config(CONFIG, [])
    g, t = cfg.generate, cfg.train
    rows = [json.loads(line) for line in (ROOT / "configs" / "data" / "successor.jsonl").read_text().splitlines()]
    # TRL draws prompts_per_iteration distinct rows per step: repeat the 8 rows so 16 fit, as our sampler
    # visits every row twice per iteration.
    reps = -(-g.prompts_per_iteration // len(rows))
    dataset = Dataset.from_list(rows * reps)
    args = GRPOConfig(output_dir=str(work / f"trl-{seed}"), use_cpu=True, bf16=False, seed=seed, data_seed=seed,
                      per_device_train_batch_size=g.prompts_per_iteration * g.num_generations,
                      num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                      temperature=g.temperature, top_p=g.top_p, learning_rate=t.lr, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=t.weight_decay, adam_beta1=t.adam_betas[0],
                      adam_beta2=t.adam_betas[1], max_grad_norm=t.max_grad_norm, loss_type=t.learner.loss_type,
                      beta=t.beta, scale_rewards=t.learner.scale_rewards, epsilon=t.learner.epsilon, num_iterations=1,
                      max_steps=iterations, logging_steps=1, report_to=[], save_strategy="no",
                      disable_tqdm=True)
    from transformers.trainer_callback import PrinterCallback, TrainerCallback

    when, t0 = [], time.perf_counter()     # as on our side: loading the model counts
    trainer = GRPOTrainer(model=resolve(cfg.model.name_or_path), args=args, reward_funcs=[successor_reward],
                          train_dataset=dataset)

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                when.append(time.perf_counter() - t0)

    trainer.remove_callback(PrinterCallback)          # keep its per-step dicts off the console
    trainer.add_callback(Clock())
    trainer.train()
    return [h["reward"] for h in trainer.state.log_history if "reward" in h][:iterations], when[:iterations]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--mode", default="auto", help="rlflow's train.mode (auto: resident)")
    ap.add_argument("--threshold", type=float, default=0.5, help="reward for the time-to-threshold line")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0], help="rlflow's run.max_staleness, each a curve")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for rlflow's side, e.g. train.off_policy_loss=decoupled")
    ap.add_argument("--no-trl", action="store_true", help="rlflow's curves only")
    keep_option(ap)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = work_folder("rlflow-curve-", args.keep)

    # Imports and first-use costs (torch, transformers, TRL, our stage code) go to neither side: a short
    # warm-up run of each, not counted.
    ours(2, 1000, work, args.mode, max(args.staleness), tuple(args.override))
    if not args.no_trl:
        trl(2, 1000, work)

    sides = {("rlflow" if args.staleness == [0] else f"rlflow S={st}"):
             (lambda i, s, w, st=st: ours(i, s, w, args.mode, st, tuple(args.override))) for st in args.staleness}
    if not args.no_trl:
        sides["TRL"] = trl
    ours_names = [n for n in sides if n != "TRL"]
    curves: dict[str, dict[int, list[float]]] = {n: {} for n in sides}
    clocks: dict[str, dict[int, list[float]]] = {n: {} for n in sides}
    seconds = {n: 0.0 for n in sides}
    for seed in args.seeds:
        for name, fn in sides.items():
            t0 = time.perf_counter()
            curves[name][seed], clocks[name][seed] = fn(args.iterations, seed, work)
            seconds[name] += time.perf_counter() - t0
            print(f"{name} seed {seed}: first {curves[name][seed][0]:.3f} last {curves[name][seed][-1]:.3f}",
                  flush=True)

    def mean_at(name, i):
        return statistics.fmean(curves[name][s][i] for s in args.seeds)

    stem = "learning_curve_vs_trl" if args.staleness == [0] else "learning_curve_staleness_vs_trl"
    with open(out / f"{stem}.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", *[f"{n}_seed{s}" for n in curves for s in args.seeds], *[f"{n}_mean" for n in curves]])
        for i in range(args.iterations):
            w.writerow([i + 1, *[f"{curves[n][s][i]:.4f}" for n in curves for s in args.seeds],
                        *[f"{mean_at(n, i):.4f}" for n in curves]])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, args.iterations + 1))
    colors = ["tab:blue", "tab:green", "tab:purple", "tab:red"]
    for name, color in [*zip(ours_names, colors), *([("TRL", "tab:orange")] if "TRL" in curves else [])]:
        for s in args.seeds:
            ax.plot(xs, curves[name][s], color=color, alpha=0.25, linewidth=0.8)
        ax.plot(xs, [mean_at(name, i) for i in range(args.iterations)], color=color, linewidth=2,
                label=f"{name} (mean of {len(args.seeds)} seeds)")
    ax.set_xlabel("iteration (one optimiser step on 16 prompts x 8 completions)")
    ax.set_ylabel("mean reward of the batch")
    ax.set_title("Demo task: GRPO (dapo), rlflow vs TRL GRPOTrainer")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=110)

    def to_threshold(name: str) -> str:
        """Mean over seeds of the seconds until a batch's mean reward first reached the threshold."""
        hits = [next((clocks[name][s][i] for i, r in enumerate(curves[name][s]) if r >= args.threshold), None)
                for s in args.seeds]
        reached = [h for h in hits if h is not None]
        return f"{statistics.fmean(reached):.1f} s ({len(reached)}/{len(hits)} seeds)" if reached else "never"

    spread = {n: (min(curves[n][s][-1] for s in args.seeds), max(curves[n][s][-1] for s in args.seeds))
              for n in curves}
    print(f"\n# learning curve, {platform.node()} ({platform.machine()}), seeds {args.seeds}, rlflow train.mode "
          f"{args.mode}; wall " + ", ".join(f"{n} {seconds[n]:.0f} s" for n in curves) + f"; time to a batch reward "
          f">= {args.threshold}: " + ", ".join(f"{n} {to_threshold(n)}" for n in curves) + "; final reward "
          "(min..max over seeds): " + ", ".join(f"{n} {lo:.3f}..{hi:.3f}" for n, (lo, hi) in spread.items()))
    print("| iteration | " + " | ".join(f"{n} (mean)" for n in curves) + " |")
    print("|---:|" + "---:|" * len(curves))
    marks = sorted({1, *range(10, args.iterations + 1, 10), args.iterations})
    for it in marks:
        print(f"| {it} | " + " | ".join(f"{mean_at(n, it - 1):.3f}" for n in curves) + " |")
    last = min(10, args.iterations)
    print(f"| mean of last {last} | " + " | ".join(
        f"{statistics.fmean(mean_at(n, i) for i in range(args.iterations - last, args.iterations)):.3f}"
        for n in curves) + " |")

if __name__ == "__main__":
    main()

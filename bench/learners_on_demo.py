"""Every learner on the demo task, side by side: GRPO (the default), PPO with a value head, PPO with a
separate critic, and V-trace + AWR (replaying the previous iteration), each the four stage functions in a
loop on a local store (bench/learning_curve_vs_trl.py: ours), with the demo's config and only
train.algorithm (and its own knobs) changed. Same seeds, same data order, same initial weights.

    python bench/learners_on_demo.py [--iterations 60] [--seeds 0 1 2] [--out docs/benchmarks]

Prints the mean reward (over seeds) at iterations 1 / 20 / 40 / last and the rise; writes
<out>/learners_on_demo.csv and .png.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from learning_curve_vs_trl import ours  # noqa: E402

LEARNERS = {
    "grpo": (),
    "ppo (value head)": ("train.algorithm=ppo",),
    "ppo (separate critic)": ("train.algorithm=ppo", "train.learner.critic=separate"),
    "vtrace_awr (replay 2)": ("train.algorithm=vtrace_awr",),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args()
    curves: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-learners-") as tmp:
        for name, extra in LEARNERS.items():
            runs, t0 = [], time.perf_counter()
            for seed in args.seeds:
                work = Path(tmp) / name.replace(" ", "_").replace("(", "").replace(")", "") / str(seed)
                runs.append(ours(args.iterations, seed, work, mode="process", extra=extra)[0])
            seconds[name] = (time.perf_counter() - t0) / len(args.seeds)
            curves[name] = [statistics.fmean(r[i] for r in runs) for i in range(args.iterations)]
    last = args.iterations
    marks = [m for m in (1, 20, 40) if m < last] + [last]
    print(f"{platform.node()}, {len(args.seeds)} seeds, {args.iterations} iterations: mean reward at "
          + " / ".join(map(str, marks)))
    print("| learner | " + " | ".join(map(str, marks)) + " | rise | s/run |")
    print("|---|" + "---|" * (len(marks) + 2))
    for name, curve in curves.items():
        print(f"| {name} | " + " | ".join(f"{curve[m - 1]:.3f}" for m in marks)
              + f" | {curve[-1] - curve[0]:+.2f} | {seconds[name]:.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "learners_on_demo.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration", *curves])
        for i in range(args.iterations):
            w.writerow([i + 1, *(f"{c[i]:.4f}" for c in curves.values())])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in curves.items():
        ax.plot(range(1, args.iterations + 1), curve, label=name)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"mean reward ({len(args.seeds)} seeds)")
    ax.set_title("The demo task, by learner (train.algorithm)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "learners_on_demo.png", dpi=120)


if __name__ == "__main__":
    main()

"""Accuracy, not format, on a suite of reasoning-gym tasks: SmolLM2-135M-Instruct trained by one recipe
(configs/smollm2-arith.yaml: the task and its config are the only change), held-out greedy accuracy at base and
after the recipe's iterations, over seeds, with the format's share and the accuracy among well-formatted answers
beside it (a gain in form alone raises the share, not the accuracy among them).

    python bench/reasoning_gym_suite.py                        # every task x seeds 0 1 2 x {plain, dynamic}
    python bench/reasoning_gym_suite.py --tasks gcd lcm --seeds 0 --variants plain
    python bench/reasoning_gym_suite.py --tasks basic_arithmetic --variants plain dynamic overlap --every 2
    python bench/reasoning_gym_suite.py --jobs 2               # two runs at once, one torch thread each
    python bench/reasoning_gym_suite.py --work DIR --report-only   # the tables of the runs kept in DIR

Variants: plain (the recipe), dynamic (+ generate.dynamic_sampling and data.curriculum), overlap (the recipe with
run.max_staleness 1), streamed (S 1, generate.streaming and dynamic sampling as groups complete). Each run is
`rlflow run` in a subprocess (bench/real_model_vs_trl.py: rlflow_run); held-out numbers are read from its
evaluate stage's stored greedy completions. Evaluation here is greedy only (eval.num_generations 1), every
--every iterations, on the recipe's 100 held-out prompts. Writes
<out>/reasoning_gym_suite.csv and .png and prints the tables docs/benchmarks.md records: per task, base and final
accuracy (mean ± std over seeds), the change, the format's share and the accuracy among formatted answers; and for
each variant the wall seconds (training clock, evaluation excluded) to each held-out level reached.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONFIG = ROOT / "configs" / "smollm2-arith.yaml"

# The suite: eight tasks of different kinds, each at a difficulty where the base model's held-out greedy accuracy
# (the recipe's answer format) lies between 0.05 and 0.5 (measured 2026-11-28 on 100 held-out prompts:
# docs/benchmarks.md).
TASKS: dict[str, dict] = {
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
                         "allow_parentheses": False, "allow_negation": False},          # arithmetic (the recipe's)
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},   # arithmetic, + and -
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},    # multiplication
    "letter_counting": {"min_words": 8, "max_words": 15},   # counting (1-3 words: "1" was right 8 times in 10)
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 30},        # number theory
    "lcm": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 12},        # number theory
    "letter_jumble": {"min_words": 1, "max_words": 1, "min_word_len": 3, "max_word_len": 5},   # string manipulation
    "count_bits": {"min_n": 1, "max_n": 1023},              # binary (isomorphic_strings' true/false: constant 0.51)
    "decimal_arithmetic": {"min_num_decimal_places": 1, "max_num_decimal_places": 1, "min_terms": 2,
                           "max_terms": 2},                 # decimals (base 0.10; not learned: docs/benchmarks.md)
}
VARIANTS = {
    "plain": [],
    "dynamic": ["generate.dynamic_sampling={max_rounds: 4}", "data.curriculum={defer: 4}"],
    "overlap": ["run.max_staleness=1"],
    "streamed": ["run.max_staleness=1", "generate.streaming.on_update=interrupt",   # dynamic sampling as groups
                 "generate.dynamic_sampling={max_rounds: 4}"],                       # complete (issue 42)
}
LEVELS = (0.3, 0.4, 0.5, 0.6)


def held_out(store_root: Path, run: str) -> dict[int, dict]:
    """Per evaluated iteration: greedy accuracy, the format's share, the accuracy among formatted answers, and two
    guards against a constant answer being taken for learning: `constant` (the accuracy of always giving the held-out
    set's most common right answer: letter_counting's "1" is right 8 times in 10) and `top_reply` (the share of the
    model's most common answer: near 1.0, the model says one thing whatever it is asked)."""
    from tasks.core import layout, rollout
    from tasks.core.store import Store
    from tasks.rewards.reasoning_gym import readings, text_of

    store = Store.open(str(store_root))
    out = {}
    for name in store.list_folders(f"{run}/eval"):
        it = int(name[1:])
        recs = rollout.load(store, layout.evaluation(run, it), layout.GREEDY)
        right = [(r.rewards.get("answer_reward") or 0.0) >= 1.0 for r in recs]
        form = [(r.rewards.get("format_reward") or 0.0) >= 1.0 for r in recs]
        n_form = sum(form)
        answers = Counter(str(r.columns.get("answer")) for r in recs)
        replies = Counter((readings(text_of(r.completion), r.columns.get("answer_format", "final")) or [""])[-1]
                          for r in recs)
        out[it] = {"accuracy": sum(right) / len(recs), "format": n_form / len(recs),
                   "accuracy_formatted": sum(a for a, f in zip(right, form) if f) / max(n_form, 1),
                   "constant": answers.most_common(1)[0][1] / len(recs),
                   "top_reply": replies.most_common(1)[0][1] / len(recs)}
    return out


def one(task: str, seed: int, variant: str, iterations: int, every: int, work: Path, threads: int | None) -> dict:
    """One run (or its result kept from an earlier invocation with the same --work)."""
    from real_model_vs_trl import rlflow_run

    overrides = [f"data.reasoning_gym.task={task}", f"data.reasoning_gym.config={json.dumps(TASKS[task])}",
                 "eval.num_generations=1", "eval.k=1", f"eval.every={every}", "publish.register_model=false",
                 *VARIANTS[variant]]
    name = f"{task}-{variant}-{seed}"
    kept = work / f"{name}.json"
    if kept.exists():
        got = json.loads(kept.read_text())
        got["held_out"] = {int(k): v for k, v in got["held_out"].items()}
        if (work / name / "store").exists():       # (read again: a result kept by an older version of this script)
            got["held_out"] = held_out(work / name / "store", name)
        return got
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)       # (inherited by the run's process)
    got = rlflow_run(CONFIG, seed, iterations, work, overrides, name=name)
    got["held_out"] = held_out(work / name / "store", name)
    got.update(task=task, seed=seed, variant=variant)
    kept.write_text(json.dumps({k: v for k, v in got.items() if k != "accuracy"}))
    for folder in ("policy", "trainer"):           # ~13 GB a run of SmolLM2 in fp32; the rollouts and evaluations stay
        shutil.rmtree(work / name / "store" / name / folder, ignore_errors=True)
    steady = got["seconds"][1:] or got["seconds"]
    print(f"{name}: {statistics.fmean(steady):.1f} s/iteration, held-out "
          + ", ".join(f"{k}: {v['accuracy']:.2f} (form {v['format']:.2f})" for k, v in sorted(got["held_out"].items())),
          flush=True)
    return got


def _ms(xs: list[float]) -> str:
    return f"{statistics.fmean(xs):.2f} ± {statistics.pstdev(xs):.2f}" if len(xs) > 1 else f"{xs[0]:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=["plain", "dynamic"], choices=list(VARIANTS))
    ap.add_argument("--iterations", type=int, default=None, help="default: the recipe's run.iterations")
    ap.add_argument("--every", type=int, default=10, help="evaluate every N iterations (and the base model)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (each with 2 // jobs torch threads)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--work", default=None, help="the runs' folder; a run whose result is there is not run again "
                    "(default: a new temporary folder)")
    ap.add_argument("--report-only", action="store_true", help="report the runs whose result is in --work; run "
                    "nothing")
    args = ap.parse_args()
    if args.report_only and not args.work:
        ap.error("--report-only needs --work")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tasks.core.config import load_config

    iterations = args.iterations or load_config(CONFIG, []).run.iterations
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="rlflow-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    jobs = [(t, s, v) for t in args.tasks for v in args.variants for s in args.seeds]
    if args.report_only:
        jobs = [(t, s, v) for t, s, v in jobs if (work / f"{t}-{v}-{s}.json").exists()]
        args.tasks = [t for t in args.tasks if any(j[0] == t for j in jobs)]
    threads = max((os.cpu_count() or 2) // args.jobs, 1) if args.jobs > 1 else None
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda j: one(*j, iterations, args.every, work, threads), jobs))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "reasoning_gym_suite.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["task", "variant", "seed", "iteration", "train_clock_seconds", "accuracy", "format_share",
                    "accuracy_formatted", "constant_answer_accuracy", "top_reply_share"])
        for r in runs:
            for it, h in sorted(r["held_out"].items()):
                w.writerow([r["task"], r["variant"], r["seed"], it, f"{sum(r['seconds'][:it]):.1f}",
                            f"{h['accuracy']:.3f}", f"{h['format']:.3f}", f"{h['accuracy_formatted']:.3f}",
                            f"{h['constant']:.3f}", f"{h['top_reply']:.3f}"])

    def of(task: str, variant: str) -> list[dict]:
        return [r for r in runs if r["task"] == task and r["variant"] == variant]

    print(f"\n# {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}, "
          f"seeds {args.seeds}, {iterations} iterations, held-out greedy accuracy on 100 prompts")
    for variant in args.variants:
        print(f"\n## {variant}\n")
        print("| task | base | after | change | seeds +0.15 | constant answer | top reply share base → after | "
              "format base → after | accuracy among formatted base → after | s/iteration |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for task in args.tasks:
            rs = of(task, variant)
            if not rs:
                continue
            base = [r["held_out"][0] for r in rs]
            last = [r["held_out"][max(r["held_out"])] for r in rs]
            change = [b["accuracy"] - a["accuracy"] for a, b in zip(base, last)]
            per_it = statistics.fmean(statistics.fmean(r["seconds"][1:] or r["seconds"]) for r in rs)
            print(f"| {task} | {_ms([b['accuracy'] for b in base])} | {_ms([b['accuracy'] for b in last])} | "
                  f"{statistics.fmean(change):+.2f} | {sum(c >= 0.15 for c in change)}/{len(change)} | "
                  f"{statistics.fmean(b['constant'] for b in base):.2f} | "
                  f"{statistics.fmean(b['top_reply'] for b in base):.2f} → "
                  f"{statistics.fmean(b['top_reply'] for b in last):.2f} | "
                  f"{statistics.fmean(b['format'] for b in base):.2f} → "
                  f"{statistics.fmean(b['format'] for b in last):.2f} | "
                  f"{statistics.fmean(b['accuracy_formatted'] for b in base):.2f} → "
                  f"{statistics.fmean(b['accuracy_formatted'] for b in last):.2f} | {per_it:.1f} |")
        def learned(t: str, variant: str = variant) -> bool:
            """Mean accuracy up by >= 0.15 and above the constant answer's by >= 0.10."""
            last = [r["held_out"][max(r["held_out"])] for r in of(t, variant)]
            after = statistics.fmean(h["accuracy"] for h in last)
            return (after - statistics.fmean(r["held_out"][0]["accuracy"] for r in of(t, variant)) >= 0.15
                    and after - statistics.fmean(h["constant"] for h in last) >= 0.10)

        ran = [t for t in args.tasks if of(t, variant)]
        print(f"\ntasks whose mean held-out accuracy rose by >= 0.15 and ends >= 0.10 above always giving the most "
              f"common answer: {sum(map(learned, ran))} of {len(ran)} ({', '.join(t for t in ran if learned(t))})")
    print("\n## wall seconds to a held-out level (training clock; mean over the seeds that reached it)\n")
    print("| task | variant | " + " | ".join(f"≥ {lv}" for lv in LEVELS) + " |")
    print("|---|---|" + "---:|" * len(LEVELS))
    for task in args.tasks:
        for variant in args.variants:
            rs = of(task, variant)
            cells = []
            for lv in LEVELS:
                hits = [next((sum(r["seconds"][:it]) for it, h in sorted(r["held_out"].items())
                              if h["accuracy"] >= lv), None) for r in rs]
                got = [h for h in hits if h is not None]
                cells.append(f"{statistics.fmean(got):.0f} s ({len(got)}/{len(hits)})" if got else "never")
            if rs:
                print(f"| {task} | {variant} | " + " | ".join(cells) + " |")
    _plot(runs, args, out)


def _plot(runs: list[dict], args, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = -(-len(args.tasks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    colors = {"plain": "tab:blue", "dynamic": "tab:green", "overlap": "tab:orange", "streamed": "tab:purple"}
    for ax, task in zip(axes.flat, args.tasks):
        for variant in args.variants:
            rs = [r for r in runs if r["task"] == task and r["variant"] == variant]
            if not rs:
                continue
            its = sorted(set.intersection(*(set(r["held_out"]) for r in rs)))
            for r in rs:
                ax.plot(its, [r["held_out"][i]["accuracy"] for i in its], color=colors[variant], alpha=0.25)
            ax.plot(its, [statistics.fmean(r["held_out"][i]["accuracy"] for r in rs) for i in its],
                    color=colors[variant], linewidth=2, marker="o", label=variant)
            ax.plot(its, [statistics.fmean(r["held_out"][i]["format"] for r in rs) for i in its],
                    color=colors[variant], linestyle=":", linewidth=1)
        ax.set_title(task, fontsize=10)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(args.tasks):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.supxlabel("iteration")
    fig.supylabel("held-out greedy accuracy (dotted: format share)")
    fig.tight_layout()
    fig.savefig(out / "reasoning_gym_suite.png", dpi=100)


if __name__ == "__main__":
    main()

"""Generation and training at the same time: iterations per hour at run.max_staleness S = 1 and 2 against S = 0
(one stage after another), the same config side by side on this machine.

    python bench/overlap_vs_sync.py [--iterations 12] [--model builtin:small-lm] [-o key=value]...

Each S runs the Prefect flow (ephemeral API) with generate and train each in a process of their own (launcher
local: a stage process per run, the resident trainer detached), one torch thread per process
(OMP_NUM_THREADS=1), reward and publish inline, no evaluation; the defaults size generate and train about
equal. Printed per S: the whole flow's wall time, the steady state (mean of iteration/seconds, the time
between two iterations' ends, over iterations 3..N: the first ones pay the trainer's start and, at S > 0, fill
the pipeline), iterations per hour at that pace and its ratio to S = 0, and the mean stage times
(time/generate_seconds: the stage process, imports and model load included, and the sampling alone;
time/train_seconds: the stage process asking the trainer, and the update alone), over iterations 2..N.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"        # every process this starts: one torch thread each
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "CRITICAL")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "tiny.yaml"


def overrides(args, work: Path, name: str, staleness: int) -> list[str]:
    return [f"run.name={name}", f"run.iterations={args.iterations}", f"run.max_staleness={staleness}",
            f"store.uri={work}/store", f"tracking.uri=sqlite:///{work}/mlflow.db", f"model.name_or_path={args.model}",
            "launcher.stages={generate: local, train: local}", f"launcher.recipes={ROOT / 'sky'}",
            "eval.every=0", "tracking.dashboard_every=0", "publish.register_model=false", "train.device=cpu",
            # generate ~6.5 s (a stage process: ~6 s of imports and loading, sampling 128 completions of <= 32
            # tokens), train ~6 s (three optimiser passes over them on the resident trainer, and the stage
            # process that asks it): about equal here
            "generate.prompts_per_iteration=8", "generate.num_generations=16", "generate.max_completion_length=32",
            "generate.batch_size=8", "train.micro_batch_size=64", "train.num_iterations=3", "train.lr=1e-4",
            *args.override]


def run(args, work: Path, staleness: int) -> dict:
    from mlflow.tracking import MlflowClient

    from flows.training import train_flow
    from tasks.core.config import load_config

    name = f"overlap-s{staleness}-{int(time.time())}"
    ov = overrides(args, work, name, staleness)
    t0 = time.perf_counter()
    summary = train_flow(str(CONFIG), ov)
    wall = time.perf_counter() - t0
    client = MlflowClient(load_config(CONFIG, ov).tracking.uri)

    def series(metric: str) -> list[float]:
        return [m.value for m in sorted(client.get_metric_history(summary["mlflow_run_id"], metric),
                                        key=lambda m: m.step)]

    steady = series("iteration/seconds")[2:]
    return {"wall": wall, "steady": statistics.fmean(steady), "reward": summary["reward_mean"][-1],
            **{k: statistics.fmean(series(m)[1:]) for k, m in (
                ("generate", "time/generate_seconds"), ("sampling", "generate/sampling_seconds"),
                ("train", "time/train_seconds"), ("update", "train/update_seconds"))}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=12)
    ap.add_argument("--model", default="builtin:small-lm")
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    if args.iterations < 4:
        raise SystemExit("--iterations: at least 4 (the steady state is measured from iteration 3 on)")
    print(f"machine: {platform.node()} ({platform.machine()}), {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; model {args.model}; {args.iterations} iterations; overrides {args.override}")
    os.chdir(ROOT)                       # the recipes run from the repository root
    rows = {}
    with tempfile.TemporaryDirectory(prefix="rlflow-overlap-") as tmp:
        for s in args.staleness:
            rows[s] = run(args, Path(tmp), s)
            print(f"S={s}: {rows[s]}", flush=True)
    base = rows.get(0)
    print("\n| S | flow wall s | steady s/iter | iterations/hour | vs S=0 | generate s (sampling) | train s "
          "(update) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for s, r in rows.items():
        ratio = f"{base['steady'] / r['steady']:.2f}x" if base else "-"
        print(f"| {s} | {r['wall']:.1f} | {r['steady']:.2f} | {3600 / r['steady']:.0f} | {ratio} | "
              f"{r['generate']:.2f} ({r['sampling']:.2f}) | {r['train']:.2f} ({r['update']:.2f}) |")


if __name__ == "__main__":
    main()

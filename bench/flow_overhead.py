"""Flow overhead: the same iterations through the Prefect flow (with store and MLflow) versus the stage
functions called in a bare Python loop (same store, no Prefect, no MLflow), side by side in one process.

    python bench/flow_overhead.py [--iterations 60] [--repeats 2] [-o key=value]...

Prints both wall times and the ratio. The Prefect API (ephemeral, or PREFECT_API_URL) is warmed up before
timing: its one-time start is reported separately, not counted as per-run overhead.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_FLOW_RUNS_LEVEL", "CRITICAL")
os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_TASK_RUNS_LEVEL", "CRITICAL")

from bench.work import keep_option, work_folder  # noqa: E402
from tasks.core import layout  # noqa: E402
from tasks.core.config import Config, load_config  # noqa: E402
from tasks.evaluate import evaluate  # noqa: E402
from tasks.generate import generate  # noqa: E402
from tasks.publish import publish  # noqa: E402
from tasks.reward import reward  # noqa: E402
from tasks.train import train  # noqa: E402


def bare_loop(cfg: Config) -> list[float]:
    out = []
    for it in range(1, cfg.run.iterations + 1):
        generate(cfg, it, layout.BASE if it == 1 else layout.policy(cfg.run.name, it - 1))
        out.append(reward(cfg, it)["metrics"]["reward/mean"])
        train(cfg, it)
        publish(cfg, it)
        if cfg.eval.every and (it % cfg.eval.every == 0 or it == cfg.run.iterations):
            evaluate(cfg, it)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=60, help="demo size: configs/tiny.yaml's 60")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-o", "--override", action="append", default=[], help="config override, e.g. a bigger batch")
    keep_option(ap)
    args = ap.parse_args()
    work = work_folder("rlflow-bench-", args.keep)
    os.chdir(work)

    config = str(ROOT / "configs" / "tiny.yaml")

    def overrides(name: str, iterations: int = args.iterations) -> list[str]:
        return [*args.override, f"run.name={name}", f"run.iterations={iterations}",
                f"tracking.uri=sqlite:///{work}/mlflow.db"]

    def cfg(name: str, iterations: int = args.iterations):
        return load_config(config, overrides(name, iterations))

    from flows.training import train_flow

    t0 = time.perf_counter()
    train_flow(config, overrides("warmup", 1))
    warm = time.perf_counter() - t0
    bare_loop(cfg("warmup-bare", 1))

    flow_t, bare_t = [], []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        a = train_flow(config, overrides(f"flow-{r}"))["reward_mean"]
        flow_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = bare_loop(cfg(f"bare-{r}"))
        bare_t.append(time.perf_counter() - t0)
        assert a == b, "flow and bare loop must do the same work"
    f, b = statistics.median(flow_t), statistics.median(bare_t)
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, python {platform.python_version()}")
    print(f"overrides: {args.override or 'none (demo size)'}")
    print(f"iterations per run: {args.iterations}; repeats: {args.repeats}; "
          f"first flow (Prefect start + 1 iter): {warm:.1f}s")
    print(f"prefect flow + store + mlflow: {f:.2f}s  ({f / args.iterations * 1000:.0f} ms/iteration)  runs: {flow_t}")
    print(f"bare loop + store:             {b:.2f}s  ({b / args.iterations * 1000:.0f} ms/iteration)  runs: {bare_t}")
    print(f"ratio flow/bare: {f / b:.3f}  (overhead {100 * (f / b - 1):+.1f}%)")


if __name__ == "__main__":
    main()

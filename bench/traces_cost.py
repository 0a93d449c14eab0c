"""What logging episodes as MLflow traces costs the recipe (tracking.traces; tasks/core/traces.py).

One iteration of configs/smollm2-arith.yaml (SmolLM2-135M-Instruct: generate, reward, train, publish) and the
evaluation of its policy (the recipe's 100 held-out prompts, greedy), through the stage functions in a temporary
folder; then the tracker's trace logging of that iteration (the samples table's 8 training completions) and of
that evaluation (every held-out episode), timed twice:

- in the flow's process (what the tracker's thread spends building spans and handing them to MLflow's exporter:
  the cost that competes with the stages),
- until MLflow has them (the exporter's queue drained: requests to the tracking server, which runs elsewhere in
  a real deployment),

(Since 2026-12-07 the tracker sends traces synchronously on its own thread: the two timings coincide unless
MLFLOW_ENABLE_ASYNC_TRACE_LOGGING=true is set.) Against an MLflow server started here (sqlite behind it) and
against a sqlite URI (no server: MLflow writes the
database from the flow's process). The share is of the iteration's measured seconds, the evaluation's cost spread
over eval.every iterations.

    python bench/traces_cost.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tasks.core import layout  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.stage import quiet_progress_bars  # noqa: E402
from tasks.core.tracking import Tracker  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(folder: Path) -> tuple[subprocess.Popen, str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{folder}/server.db", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the MLflow server did not start")


def measure(path: Path, overrides: list[str], uri: str, it: int, metrics: dict, repeats: int) -> dict:
    import mlflow

    cfg = load_config(path, [*overrides, f"tracking.uri={uri}"])
    out: dict[str, list[float]] = {"train": [], "train_exported": [], "eval": [], "eval_exported": []}
    for _ in range(repeats):
        tracker = Tracker(cfg, cfg.store.uri)
        tracker.start()
        key = layout.evaluation(cfg.run.name, it)
        for split, traces in (("train", [("train", layout.rewards(cfg.run.name, it))]),
                              ("eval", [("eval", key), ("eval-greedy", key)])):
            t0 = time.perf_counter()
            tracker._traces(it, dict(metrics), traces)
            out[split].append(time.perf_counter() - t0)
            mlflow.flush_trace_async_logging()
            out[f"{split}_exported"].append(time.perf_counter() - t0)
        tracker.client.set_terminated(tracker.run_id)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    quiet_progress_bars()
    from tasks.evaluate import evaluate
    from tasks.generate import generate
    from tasks.publish import publish
    from tasks.reward import reward
    from tasks.train import finish_trainer, train

    with tempfile.TemporaryDirectory(prefix="rlflow-traces-bench-") as tmp:
        overrides = [f"store.uri=file://{tmp}/store", f"tracking.uri=sqlite:///{tmp}/m.db", "run.name=traces"]
        path = ROOT / "configs" / "smollm2-arith.yaml"
        cfg = load_config(path, overrides)
        t0 = time.perf_counter()
        g = generate(cfg, 1)
        r = reward(cfg, 1)
        train(cfg, 1)
        publish(cfg, 1)
        iteration_s = time.perf_counter() - t0
        finish_trainer(cfg)
        t0 = time.perf_counter()
        e = evaluate(cfg, 1)
        eval_s = time.perf_counter() - t0
        metrics = {**g["metrics"], **r["metrics"]}
        proc, url = _server(Path(tmp))
        try:
            rows = {"MLflow server": measure(path, overrides, url, 1, metrics, args.repeats),
                    "sqlite URI (no server)": measure(path, overrides, f"sqlite:///{tmp}/direct.db", 1, metrics,
                                                      args.repeats)}
        finally:
            proc.terminate()
            proc.wait()
    every = cfg.eval.every
    n_eval = int(e["metrics"].get("eval/prompts", 0))
    print(f"\nEpisodes as traces, configs/smollm2-arith.yaml; {time.strftime('%Y-%m-%d')}, {platform.machine()}, "
          f"{os.cpu_count()} cores. One iteration {iteration_s:.1f} s (generate, reward, train, publish), its "
          f"evaluation {eval_s:.1f} s ({n_eval} prompts), eval.every {every}; median of {args.repeats}.\n")
    print("| tracking | training traces (8): in the flow / exported | evaluation traces: in the flow / exported | "
          "share of an iteration in the flow (train + eval / every) | exported |")
    print("|---|---:|---:|---:|---:|")
    for name, m in rows.items():
        med = {k: statistics.median(v) for k, v in m.items()}
        share = (med["train"] + med["eval"] / every) / iteration_s
        share_x = (med["train_exported"] + med["eval_exported"] / every) / iteration_s
        print(f"| {name} | {med['train']:.3f} / {med['train_exported']:.3f} s | {med['eval']:.3f} / "
              f"{med['eval_exported']:.3f} s | {share:.2%} | {share_x:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

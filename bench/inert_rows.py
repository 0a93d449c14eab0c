"""What skipping the backward of rows of advantage 0 saves (tasks/algorithms/update.py): one update of each stored
iteration of a run, timed with the skip and with every row trained (the reference), side by side from the same
weights, alternating, the median of --repeats each.

    python bench/inert_rows.py --store /tmp/r/rlflow-store --run smollm2-arith      # a run of the recipe
    python bench/inert_rows.py --config configs/smollm2-arith.yaml --store ... --run ... --iterations 1 4

The rows are the run's own scored rollouts (rewards/ of each iteration), the update starts from the base model
each time (the cost of an update does not depend on the weights); single-turn rows (prepare_batches, as the
train stage batches them on one process). Prints per iteration: the rows that learn,
seconds with the skip, seconds training every row, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-arith.yaml"))
    ap.add_argument("--store", required=True)
    ap.add_argument("--run", required=True)
    ap.add_argument("--iterations", type=int, nargs="*", help="which stored iterations (default: every one)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from tasks.algorithms import update
    from tasks.algorithms.batching import prepare_batches
    from tasks.algorithms.learners.registry import make
    from tasks.core import layout, rollout
    from tasks.core.config import load_config
    from tasks.core.store import open_store
    from tasks.engines.torch_engine import TorchEngine

    cfg = load_config(args.config, [f"store.uri={args.store}", f"run.name={args.run}"])
    store = open_store(cfg)
    iterations = args.iterations or []
    while not args.iterations and store.manifest(layout.rewards(args.run, len(iterations) + 1)):
        iterations.append(len(iterations) + 1)
    print(f"{'iteration':>9} {'rows learning':>14} {'skip s':>8} {'every row s':>12} {'ratio':>6}")
    ratios = []
    for k in iterations:
        records = rollout.load(store, layout.rewards(args.run, k))
        rewards = torch.tensor([float("nan") if r.reward is None else r.reward for r in records])
        seconds: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for skip in (True, False):
                torch.manual_seed(0)
                engine, learner = TorchEngine.open(cfg, None, None), make(cfg, k)
                signal = learner.signal(rewards)
                batches = prepare_batches(records, signal, engine.tokenizer.pad_token_id, cfg.train, "cpu")
                engine.partial_backward = skip          # (off: every row's backward runs, as on DeepSpeed)
                t0 = time.perf_counter()
                update.optimise(engine, batches, cfg, k, learner)
                seconds[skip].append(time.perf_counter() - t0)
        a, b = statistics.median(seconds[True]), statistics.median(seconds[False])
        ratios.append(a / b)
        learning = sum(int(((b.signal != 0) & (b.mask.sum(-1) > 0)).sum()) for b in batches)
        print(f"{k:>9} {learning:>8} of {len(signal):<3} {a:>8.2f} {b:>12.2f} {a / b:>6.2f}",
              flush=True)
    print(f"median ratio (skip / every row): {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()

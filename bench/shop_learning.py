"""SmolLM2-135M in the shop (configs/smollm2-shop.yaml): held-out success of the base model, after the warm start
(SFT on the reference policy's episodes of the 41 training tasks), and after RL from each, over seeds.

    .venv/bin/python bench/shop_learning.py [--seeds 0 1 2] [--iterations 10] [--arms base "warm start"]

Serves the shop on a free port of 127.0.0.1, records the demonstrations (rlflow record), then each arm is a real
`rlflow run` of the recipe: eval.baseline gives the starting policy's held-out success ("start": the base model, or
v0 after SFT), the evaluation at the last iteration the "after RL" one. Success is the task's checker (1 or 0) on
the 13 held-out tasks (webshop.HELD_OUT: products, searches, a category and people never in training), greedy. The
format's share: an episode scores only when its checker passes; an action in the right format earns nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "configs" / "smollm2-shop.yaml"

from bench.warm_start_letters import compare_arms, rlflow  # noqa: E402
from bench.work import keep_option, work_folder  # noqa: E402
from tasks.envs.builtin.webshop import order_pool, serve, shop_tasks  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--arms", nargs="+", default=["base", "warm start"], choices=["base", "warm start"])
    ap.add_argument("--repeat-rare", type=int, default=1, metavar="N",
                    help="the demonstrations of the kinds that are not a product lookup (the searches, categories "
                    "and orders: 23 of the 41) N times in the SFT data, so that each kind weighs about as much")
    ap.add_argument("--rl-kinds", nargs="+", metavar="KIND",
                    help="RL on the training tasks of these kinds only (e.g. search cheapest 'most expensive' order: "
                    "the product lookups, which SFT already solves, teach RL nothing); SFT still on every one")
    ap.add_argument("--pool", type=int, default=0, metavar="N",
                    help="demonstrations of N generated training orders too (webshop.order_pool: other customers, "
                    "quantities, sizes and shippings on the training products); RL still on the recipe's tasks")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="for every arm's run, e.g. -o warmup.epochs=2")
    keep_option(ap)
    args = ap.parse_args()
    work = work_folder("rlflow-shop-", args.keep)
    t0 = time.perf_counter()
    with serve() as url:
        demos = ["-o", f"warmup.path={work / 'demos.jsonl'}"]      # (the base arm has no warmup: each key once)
        common = ["-o", f"env.kwargs.base_url={url}", "-o", f"run.iterations={args.iterations}",
                  "-o", f"eval.every={args.iterations}", *(a for o in args.override for a in ("-o", o))]
        pool = []
        if args.pool:                           # the demonstrations' tasks: the training split and generated orders
            pool = data_file(work / "demo_tasks.jsonl", shop_tasks("train") + order_pool(args.pool, seed=1))
        out = rlflow(["record", str(RECIPE), "--policy", "tasks.envs.builtin.webshop:reference_action", "--out",
                      str(work / "demos.jsonl"), *common, *demos, *pool], work)
        print(out.stderr.strip().splitlines()[-1], f"({time.perf_counter() - t0:.0f} s)")
        if args.repeat_rare > 1:
            print(f"{repeat_rare(work / 'demos.jsonl', args.repeat_rare)} demonstrations after repeating the rare "
                  f"kinds {args.repeat_rare} times")
        print(f"SmolLM2-135M in the shop, 13 held-out tasks, {args.iterations} RL iterations; greedy success")
        rl = []
        if args.rl_kinds:
            rows = [t for t in shop_tasks("train") if t["kind"] in args.rl_kinds]
            rl = data_file(work / "rl.jsonl", rows)
            print(f"RL on the {len(rows)} training tasks of kinds {', '.join(args.rl_kinds)}")
        every = {"base": ["-o", "warmup=null", *rl], "warm start": [*demos, *rl]}
        compare_arms(RECIPE, common, {arm: every[arm] for arm in args.arms}, args.seeds, args.iterations, work)
    return 0


def data_file(path: Path, rows: list[dict]) -> list[str]:
    """`rows` written to `path` as JSON lines; the override that makes them a run's data."""
    path.write_text("".join(json.dumps(t) + "\n" for t in rows))
    return ["-o", f"data.path={path}"]


def repeat_rare(demos: Path, times: int) -> int:
    """The demonstrations whose task is not a product's price or stock (the task's `kind`) written `times` times
    over; their count."""
    lookups = {f"Task: {t['prompt']}" for t in shop_tasks() if t["kind"] in ("price", "stock")}
    lines = demos.read_text().splitlines()
    out = [line for line in lines
           for _ in range(1 if any(t in json.loads(line)["messages"][0]["content"] for t in lookups) else times)]
    demos.write_text("\n".join(out) + "\n")
    return len(out)


if __name__ == "__main__":
    sys.exit(main())

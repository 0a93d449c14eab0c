"""The whole RL loop in one screen: the four stage functions in a plain Python loop, no Prefect, no launcher.

    python -m flows.minimal_loop configs/tiny.yaml --store /tmp/rlflow-minimal --iterations 3

Read this before flows/training.py. It runs the same stage functions the real flow runs, in the same order,
on a store in a local folder, so it writes the artifacts the flow would (a flow run on the same store and run
name reuses them instead of computing them again). What the real flow adds around this loop, and where:
  - preflight (flows/preflight.py): every input mistake as one line before anything is written;
  - a lease (tasks/core/lease.py): one writer per run name; MLflow metrics and the Prefect dashboard;
  - launchers (flows/launch.py): a stage in a subprocess or on a SkyPilot cluster instead of this process;
  - retries of infrastructure failures, repair of corrupt artifacts (flows/repair.py);
  - run.max_staleness > 0: generate and reward of later iterations beside this one's train (flows/schedule.py);
  - held-out evaluation (tasks/evaluate.py), retention (store.keep), the resident trainer's final checkpoint.
"""

from __future__ import annotations

import argparse

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.stage import quiet_progress_bars
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import train


def minimal_loop(config: str, store: str, iterations: int) -> list[float]:
    """Run `iterations` iterations of `config` on the local folder `store`; returns each one's mean reward."""
    # The config is typed and checked (tasks/core/config.py); overrides are dotted `key=value` strings, the same
    # ones `rlflow run -o` takes. Here: where the store is, and how many iterations to run.
    cfg = load_config(config, [f"store.uri={store}", f"run.iterations={iterations}"])
    run = cfg.run.name
    means = []
    for it in range(1, iterations + 1):
        # 1. generate: sample generate.num_generations completions for each of this iteration's prompts from the
        #    policy the schedule names: v(it-1) (the base model at it = 1), with run.max_staleness S: v(it-1-S).
        #    Writes <run>/iter-<it>/rollouts: token ids, text and the sampler's logprobs of every token.
        policy = layout.behaviour_policy(run, it, cfg.run.max_staleness)
        generate(cfg, it, policy)
        # 2. reward: the reward functions (reward.functions, TRL's signature) score every completion, in a
        #    worker process with a timeout. Writes <run>/iter-<it>/rewards: per-function scores and their sum.
        r = reward(cfg, it)
        # 3. train: one update on those scored rollouts (GRPO by default: advantages within each prompt's group
        #    of completions, the clipped loss of tasks/algorithms/loss.py). Writes <run>/trainer/ckpt-<it>.
        t = train(cfg, it)
        # 4. publish: the checkpoint's weights become the policy v<it> that the next generate samples from, and
        #    <run>/policy/LATEST moves to it.
        p = publish(cfg, it)
        # Every stage returns {key, uri, metrics} and meets the others only in the store: each reads the
        # previous one's folder by its key. A stage whose output is already there from the same inputs returns
        # it at once, so running this again (or after a kill) redoes nothing.
        means.append(r["metrics"]["reward/mean"])
        print(f"iter {it}/{iterations}  reward {r['metrics']['reward/mean']:.3f}  "
              f"loss {t['metrics']['train/loss']:+.4f}  -> {p['uri']}", flush=True)
    return means


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m flows.minimal_loop", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default="configs/tiny.yaml")
    ap.add_argument("--store", default="rlflow-minimal", help="a local folder (made if missing)")
    ap.add_argument("--iterations", type=int, default=3)
    args = ap.parse_args()
    quiet_progress_bars()               # (the iteration lines are the output)
    minimal_loop(args.config, args.store, args.iterations)


if __name__ == "__main__":
    main()

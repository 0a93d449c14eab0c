"""Stage 5 (optional) — evaluate: score a published policy on held-out prompts, and keep the best policy.

    python -m tasks.evaluate --config configs/tiny.yaml --iteration 10

Reads `<run>/policy/vN`; samples `eval.num_generations` completions for each of the first `eval.max_prompts`
rows of the held-out split; scores them with the run's reward functions; writes `<run>/eval/vN` (scored
completions; metrics eval/reward_mean and eval/pass_at_K in the manifest); then points `<run>/policy/BEST` at
vN if its `eval.metric` beats the current best's. Idempotent like every stage: a complete `<run>/eval/vN`
from the same inputs is reused, and the BEST decision is simply taken again.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import data, layout, rollout
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import Store, open_store
from tasks.engines.sampling import SamplingParams
from tasks.envs.episodes import sample
from tasks.scoring.functions import load_functions, score_records
from tasks.scoring.worker import RewardState

if TYPE_CHECKING:
    from tasks.core.config import Config


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passing (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _update_best(store: Store, cfg: Config, iteration: int, metrics: dict) -> None:
    run, name = cfg.run.name, cfg.eval.metric_key()
    current = store.get_pointer(layout.best(run))
    if current is not None:
        best_iter = layout.version_of(current)
        if best_iter == iteration:
            return
        best = store.manifest(layout.evaluation(run, best_iter))
        if best is not None and best["meta"]["metrics"][name] >= metrics[name]:
            return                                   # ties keep the earlier policy
    store.set_pointer(layout.best(run), layout.policy(run, iteration))


def evaluate(cfg: Config, iteration: int) -> dict:
    """Evaluate published policy v`iteration`; returns {key, uri, metrics}."""
    store = open_store(cfg)
    ec = cfg.eval
    key = layout.evaluation(cfg.run.name, iteration)
    policy = layout.policy(cfg.run.name, iteration)
    pm = require_input(store, policy, iteration, "published policy", "publish")
    fp = fingerprint(cfg, ("eval", "reward", "data", *cfg.env_sections()), iteration=iteration,
                     policy=sorted((k, v["sha256"]) for k, v in pm["files"].items()))
    done = reuse(store, key, fp)
    if done is None:
        t0 = time.perf_counter()
        functions = load_functions(cfg)
        ds = data.load_prompts(cfg, split="eval")
        rows = list(range(min(ec.max_prompts, len(ds))))
        records, _ = sample(cfg, ds, rows, policy, SamplingParams(
            n=ec.num_generations, max_new_tokens=cfg.generate.max_completion_length,
            temperature=ec.temperature or cfg.generate.temperature, top_p=cfg.generate.top_p,
            seed=cfg.run.seed * 1_000_003 + 500_000_000 + iteration))
        score_records(functions, records, cfg.reward.aggregate,
                      RewardState(global_step=iteration, max_steps=cfg.run.iterations))
        passed = [0] * len(rows)
        for r in records:
            passed[r.group] += int(r.reward is not None and r.reward >= ec.pass_threshold)
        present = [r.reward for r in records if r.reward is not None]
        metrics = {"eval/reward_mean": sum(present) / max(len(present), 1),
                   f"eval/pass_at_{ec.k}": sum(pass_at_k(ec.num_generations, c, ec.k) for c in passed) / len(rows),
                   "eval/prompts": float(len(rows)), "eval/seconds": time.perf_counter() - t0}
        with tempfile.TemporaryDirectory(prefix="rlflow-eval-") as tmp:
            rollout.write(records, Path(tmp))
            done = result(store, key, store.put_folder(key, Path(tmp), meta={"fingerprint": fp, "metrics": metrics}))
    _update_best(store, cfg, iteration, done["metrics"])
    return done


if __name__ == "__main__":
    stage_cli(evaluate, "evaluate")

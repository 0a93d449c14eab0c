"""Stage 2 — reward: score every completion with the configured reward functions.

    python -m tasks.reward --config configs/tiny.yaml --iteration 3

A reward function has TRL's signature and is named by import path with a weight:

    def successor_reward(completions: list[str], **columns) -> list[float | None]: ...
    reward.functions: [{fn: "tasks.rewards.demo:successor_reward", weight: 1.0}]

Dataset columns (other than the prompt) arrive as keyword lists, plus `prompts` and `completion_ids`.
`None` means "not applicable". The module is importable from the current directory. Functions run in a
worker process with a timeout (tasks/scoring/functions.py): one that raises, hangs or returns garbage scores
nothing for the batch and is counted in `reward/<fn>/errors`, or fails the stage with `reward.strict: true`.
Reward models and LLM judges (reward.models) score beside the functions (tasks/scoring/judges.py), their answers
cached under `<run>/judge-cache/iter-N` as they come, so a retried stage asks nothing twice.
Reads `<run>/iter-N/rollouts`, writes `<run>/iter-N/rewards` with per-function scores and the weighted sum.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import layout, rollout
from tasks.core.errors import UserError
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import open_store
from tasks.scoring.functions import load_functions, score_records
from tasks.scoring.worker import RewardState

if TYPE_CHECKING:
    from tasks.core.config import Config


def reward(cfg: Config, iteration: int) -> dict:
    """Score iteration `iteration`'s rollouts; returns {key, uri, metrics}."""
    store = open_store(cfg)
    key = layout.rewards(cfg.run.name, iteration)
    src = layout.rollouts(cfg.run.name, iteration)
    src_manifest = require_input(store, cfg, "reward", iteration, ("generate", iteration))
    fp, made = fingerprint(cfg, ("reward", *cfg.env_sections()), iteration=iteration,
                           rollouts=src_manifest["files"][rollout.FILE]["sha256"])
    if (done := reuse(store, key, fp, made)) is not None:
        return {**done, "samples": store.manifest(key)["meta"].get("samples", [])}

    t0 = time.perf_counter()
    functions = load_functions(cfg)
    records = rollout.load(store, src)
    scored = score_records(functions, records, cfg.reward.aggregate,
                           RewardState(global_step=iteration - 1, max_steps=cfg.run.iterations),
                           judge_cache=layout.judge_cache(cfg.run.name, iteration))
    present = [r.reward for r in records if r.reward is not None]
    if records and not present and scored.errors:
        raise UserError(f"reward: every reward call of iteration {iteration} failed, no completion was scored "
                        f"(nothing to train on); the first: {next(iter(scored.errors.values()))}")
    metrics = {"reward/mean": sum(present) / max(len(present), 1),
               "reward/std": _std(present),
               "reward/missing_share": 1 - len(present) / len(records),
               "reward/seconds": time.perf_counter() - t0}
    for name, vals in scored.scores.items():
        got = [v for v in vals if v is not None]
        metrics[f"reward/{name}/mean"] = sum(got) / max(len(got), 1)
        metrics[f"reward/{name}/errors"] = float(name in scored.errors)
        metrics[f"reward/{name}/nan"] = float(scored.nan.get(name, 0))
    metrics.update({f"reward/{k}": v for k, v in scored.metrics.items()})
    n = cfg.tracking.sample_completions
    step = max(len(records) // max(n, 1), 1)
    samples = [{"prompt": r.prompt, "completion": r.completion, "reward": r.reward,
                **{f"reward/{k}": v for k, v in r.rewards.items()}, **r.extra} for r in records[::step][:n]]
    with tempfile.TemporaryDirectory(prefix="rlflow-reward-") as tmp:
        rollout.write(records, Path(tmp))
        manifest = store.put_folder(key, Path(tmp), meta={"fingerprint": fp, "made_of": made, "metrics": metrics,
                                                          "samples": samples, "errors": scored.errors})
    return {**result(store, key, manifest), "samples": manifest["meta"]["samples"]}


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


if __name__ == "__main__":
    stage_cli(reward, "reward")

"""Stage 2 — reward: score every completion with the configured reward functions.

    python -m tasks.reward --config configs/tiny.yaml --iteration 3 [--round R]   (generate.dynamic_sampling)

A reward function has TRL's signature and is named by import path with a weight:

    def successor_reward(completions: list[str], **columns) -> list[float | None]: ...
    reward.functions: [{fn: "tasks.rewards.demo:successor_reward", weight: 1.0}]

Functions run in a worker process with a timeout (tasks/scoring/functions.py); reward models and LLM judges
(reward.models) score beside them (tasks/scoring/judges.py); reward.overlong adds DAPO's overlong punishment
(tasks/scoring/shaping.py). Reads `<run>/iter-N/rollouts`, writes `<run>/iter-N/rewards` with per-function
scores and the weighted sum.
More: docs/internals.md (tasks/reward.py): the functions' arguments, failures, the judges' cache, dynamic
sampling's rounds.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.algorithms import dynamic_sampling
from tasks.core import layout, rollout
from tasks.core.contracts import Scored
from tasks.core.errors import UserError
from tasks.core.placement import placement_of
from tasks.core.stage import check_round, command, fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import Store, open_store
from tasks.scoring.functions import load_functions, require_some_score, score_records
from tasks.scoring.logged import logged_metrics
from tasks.scoring.shaping import NAME as SHAPING
from tasks.scoring.shaping import add_overlong, overlong_metrics, task_reward
from tasks.scoring.streamed import assembled
from tasks.scoring.worker import RewardState

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.placement import Services


def reward(cfg: Config, iteration: int, round: int = 0, services: Services | None = None) -> dict:
    """Score iteration `iteration`'s rollouts (dynamic sampling's round `round`); returns {key, uri, metrics,
    samples, complete} (complete: the iteration's training batch is in `<run>/iter-N/rewards`). `services`: the
    stage's context (the judge servers; None: what this process's environment says)."""
    check_round(cfg, round)
    store = open_store(cfg)
    ds = cfg.generate.dynamic_sampling
    key = layout.rewards(cfg.run.name, iteration) if ds is None else layout.scored(cfg.run.name, iteration, round)
    src = layout.rollouts(cfg.run.name, iteration, round)
    if round == 0:
        src_manifest = require_input(store, cfg, "reward", iteration, ("generate", iteration))
    elif (src_manifest := store.manifest(src)) is None:
        raise UserError(f"reward of iteration {iteration} round {round}: no complete rollouts at {store.uri(src)}; "
                        f"run first: {command('generate', iteration)} --round {round}")
    fp, made = fingerprint(cfg, ("reward", *cfg.env_sections()), iteration=iteration,
                           rollouts=src_manifest["files"][rollout.FILE]["sha256"])
    done = reuse(store, key, fp, made)
    if done is None:
        t0 = time.perf_counter()
        records = rollout.load(store, src)
        streamed = assembled(cfg, store, iteration, records) if placement_of(cfg).scores_as_groups_complete() \
            else None
        if streamed is not None:                                                  # scored as they completed
            records, scored, seconds = streamed
            shaped = {**overlong_metrics(records), "reward/streamed_seconds": seconds}
        else:
            scored = score_records(load_functions(cfg), records, cfg.reward.aggregate,
                                   RewardState(global_step=iteration - 1, max_steps=cfg.run.iterations),
                                   judge_cache=layout.judge_cache(cfg.run.name, iteration, round=round),
                                   services=services)
            shaped = add_overlong(cfg, records)
        skippable = not cfg.reward.strict and _was_scored(cfg, store, iteration - 1)
        if not (skippable and ds is not None):   # (dynamic sampling: said once, of all its rounds, _keep)
            require_some_score(records, scored, f"iteration {iteration}", skippable=skippable)
        metrics = {**_metrics(records, scored.scores), "reward/seconds": time.perf_counter() - t0}
        for name in scored.scores:
            metrics[f"reward/{name}/errors"] = float(name in scored.errors)
            metrics[f"reward/{name}/nan"] = float(scored.nan.get(name, 0))
        metrics.update(shaped)
        metrics.update(_group_shares(cfg, [records]))
        logged = logged_metrics(scored.metrics, metrics)
        metrics.update(logged)
        # ("logged": which of the metrics are what the functions and judges logged, under the names they logged:
        # dynamic sampling's last round combines the rounds' by those, _logged_of_rounds)
        done = _write(store, key, records, {"fingerprint": fp, "made_of": made, "metrics": metrics,
                                            "samples": _samples(cfg, records), "errors": scored.errors,
                                            "groups": _outcomes(cfg, records),
                                            "logged": dict(zip(logged, scored.metrics))})
    done = {**done, "samples": store.manifest(key)["meta"].get("samples", []), "complete": ds is None}
    return done if ds is None else _keep(cfg, store, iteration, round, done)


def _keep(cfg: Config, store: Store, iteration: int, round: int, scored: dict) -> dict:
    """Dynamic sampling after round `round`: the rounds' kept groups written as the iteration's rewards when
    there are enough of them or no round is left (complete), else this round's result (not complete). Under
    generate.streaming round 0 holds them all (the sampler started one more group per constant one): always
    complete, its groups cut into the stage mode's rounds."""
    ds, P = cfg.generate.dynamic_sampling, cfg.generate.prompts_per_iteration
    keys = [layout.scored(cfg.run.name, iteration, r) for r in range(round + 1)]
    rounds = scored_rounds = [rollout.load(store, k) for k in keys]
    if cfg.generate.streaming is not None:
        rounds = dynamic_sampling.as_rounds(rounds[0], P, ds.prompts_per_round or P)
    elif round + 1 < ds.max_rounds and not dynamic_sampling.enough(rounds, P, ds.tolerance):
        return scored
    key = layout.rewards(cfg.run.name, iteration)
    fp, made = fingerprint(cfg, ("reward", "generate", *cfg.env_sections()), iteration=iteration,
                           scored=[store.manifest(k)["files"][rollout.FILE]["sha256"] for k in keys])
    done = reuse(store, key, fp, made)
    if done is None:
        kept, metrics = dynamic_sampling.select(rounds, P, ds.tolerance)
        every = [r for records in rounds for r in records]
        metas = [store.manifest(k)["meta"] for k in keys]
        errors = {name: e for meta in metas for name, e in meta.get("errors", {}).items()}
        require_some_score(every, Scored(errors=errors), f"iteration {iteration}", skippable=True)   # (warns)
        scores = {name: [r.rewards.get(name) for r in every] for name in every[0].rewards if name != SHAPING}
        for meta in metas:                        # per round: summed (seconds, errors) or of all rounds (means)
            for name, value in meta["metrics"].items():
                if name.endswith(("seconds", "/errors", "/nan")) and name not in meta.get("logged", {}):
                    metrics[name] = metrics.get(name, 0.0) + value
        metrics.update(_metrics(every, scores))
        metrics.update(overlong_metrics(every))
        metrics.update(_group_shares(cfg, rounds))
        given = [x for r in kept if (x := task_reward(r)) is not None]
        metrics["reward/kept_mean"] = _mean(given) if given else math.nan      # (nothing scored: no mean)
        metrics.update(logged_metrics(_logged_of_rounds(cfg, metas, scored_rounds), metrics))
        done = _write(store, key, kept, {"fingerprint": fp, "made_of": made, "metrics": metrics,
                                         "samples": _samples(cfg, kept), "errors": errors})
    return {**done, "samples": store.manifest(key)["meta"].get("samples", []), "complete": True}


def _logged_of_rounds(cfg: Config, metas: list[dict], rounds: list[list]) -> dict[str, float]:
    """What the functions logged with log_metric in the rounds (their manifests' `metas`, their scored `rounds`),
    by the names they logged: each name's round values weighted by the completions the round scored, so the mean
    over every completion's call that one batch of them all logs (as TRL does for a batch, and the stage without dynamic
    sampling for its one call); a round whose call logged no such name (it failed) is left out of its mean.
    reward.models' counts and seconds (<model>/requests ...) are summed, as the rounds' seconds and errors are."""
    judges = tuple(f"{m.name}/" for m in cfg.reward.models)
    sums: dict[str, list[float]] = {}
    for meta, records in zip(metas, rounds):
        for key, name in meta.get("logged", {}).items():
            total, summed = sums.setdefault(name, [0.0, 0]), name.startswith(judges)
            total[0] += meta["metrics"][key] * (1 if summed else len(records))
            total[1] += 0 if summed else len(records)
    return {name: s / n if n else s for name, (s, n) in sums.items()}


def _was_scored(cfg: Config, store: Store, iteration: int) -> bool:
    """Whether iteration `iteration`'s training batch holds a scored completion (False for iteration 0, and for
    one whose rewards are not in the store)."""
    manifest = store.manifest(layout.rewards(cfg.run.name, iteration)) if iteration > 0 else None
    return manifest is not None and manifest["meta"].get("metrics", {}).get("reward/missing_share", 1.0) < 1.0


def _metrics(records: list, scores: dict[str, list]) -> dict[str, float]:
    """reward/mean, std, missing share and each function's mean, over `records` (the task's rewards: shaping,
    reward.overlong, is reported apart). A function that scored nothing in this batch has no mean (not a 0 that
    reads as a score; reward/<fn>/errors says why); a batch nothing scored has reward/mean and std NaN (its step
    is skipped: logged, so that the iteration is there, as no number)."""
    present = [x for r in records if (x := task_reward(r)) is not None]
    metrics = {"reward/mean": _mean(present) if present else math.nan, "reward/std": _std(present) if present
               else math.nan,
               "reward/missing_share": 1 - len(present) / max(len(records), 1)}
    for name, vals in scores.items():
        if given := [v for v in vals if v is not None]:
            metrics[f"reward/{name}/mean"] = _mean(given)
    return metrics


def _group_shares(cfg: Config, rounds: list[list]) -> dict[str, float]:
    """Shares of the groups (of every round: each round numbers its groups from 0) whose rewards are all equal
    (dynamic sampling's test: no advantage) and that all passed (easy: eval.pass_reward's score, or the task's
    reward without reward.overlong's shaping, at least eval.pass_threshold), all equal and not all passed
    (hard), or not all equal (useful: the only ones that teach)."""
    ds = cfg.generate.dynamic_sampling
    tolerance = ds.tolerance if ds else dynamic_sampling.TOLERANCE

    def passed(r) -> bool:
        score = task_reward(r) if cfg.eval.pass_reward is None else r.rewards.get(cfg.eval.pass_reward)
        return score is not None and score >= cfg.eval.pass_threshold

    n = easy = useful = 0
    for records in rounds:
        flags = dynamic_sampling.constant_groups(records, tolerance)
        groups = dynamic_sampling.groups_of(records)
        n += len(flags)
        easy += sum(flags[g] and all(passed(r) for r in groups[g] if not r.part) for g in flags)
        useful += sum(not c for c in flags.values())
    if not n:
        return {}
    return {"reward/groups_useful": useful / n, "reward/groups_easy": easy / n,
            "reward/groups_hard": (n - useful - easy) / n}


def _outcomes(cfg: Config, records: list) -> list[list]:
    """[row, constant] of each group, in order: what the curriculum learns from (tasks/core/curriculum.py)."""
    ds = cfg.generate.dynamic_sampling
    flags = dynamic_sampling.constant_groups(records, ds.tolerance if ds else dynamic_sampling.TOLERANCE)
    rows = {g: rs[0].row for g, rs in dynamic_sampling.groups_of(records).items()}
    return [[rows[g], flag] for g, flag in flags.items()]


def _samples(cfg: Config, records: list) -> list[dict]:
    """The samples table's rows (tasks/core/traces.py: sample_rows picks them, and the same records' traces)."""
    from tasks.core.traces import sample_rows

    # (a function's log_extra columns first: one named prompt, completion or reward cannot replace the run's own)
    return [{**r.extra, "prompt": r.prompt, "completion": r.completion, "reward": r.reward,
             **{f"reward/{k}": v for k, v in r.rewards.items()}}
            for r in (records[i] for i in sample_rows(len(records), cfg.tracking.sample_completions))]


def _write(store: Store, key: str, records: list, meta: dict) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlflow-reward-") as tmp:
        rollout.write(records, Path(tmp))
        return result(store, key, store.put_folder(key, Path(tmp), meta=meta))


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


if __name__ == "__main__":
    stage_cli(reward, "reward", takes_round=True, takes_services=True)

"""Stage 5 (optional) — evaluate: score a published policy on held-out prompts, and keep the best policy.

    python -m tasks.evaluate --config configs/tiny.yaml --iteration 10
    python -m tasks.evaluate --config configs/smollm2-arith.yaml --iteration 0     # the base model (eval.baseline)

Reads `<run>/policy/vN`; samples `eval.num_generations` completions for each of the first `eval.max_prompts`
rows of the held-out split (and with `eval.greedy` one greedy completion each); scores them with the run's
reward functions; writes `<run>/eval/vN` (scored completions; metrics eval/reward_mean, eval/pass_at_K and
eval/greedy_pass_at_1 in the manifest); then points `<run>/policy/BEST` at vN if its `eval.metric` beats the
current best's, and the starting model's (`eval.baseline`: iteration 0 evaluates the base model into
`<run>/eval/v000000`). A completion passes when its combined reward, or `eval.pass_reward`'s score, reaches
`eval.pass_threshold`. Idempotent like every stage: a complete `<run>/eval/vN` from the same inputs is reused,
and the BEST decision is simply taken again. An environment that pictures its pages (the browser) does so for the
first `eval.screenshots` episodes: `<run>/eval/vN/screens` (tasks/envs/runtime/screens.py).
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import data, layout, rollout
from tasks.core.contracts import SamplingParams, Scored
from tasks.core.errors import UserError
from tasks.core.placement import Services
from tasks.core.retention import improves
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import Store, open_store
from tasks.engines.sampling import open_session
from tasks.envs.runtime.screens import file_frames, takes_screenshots, with_screenshots
from tasks.envs.runtime.sources import source_of
from tasks.scoring.functions import load_functions, require_some_score, score_records
from tasks.scoring.logged import logged_metrics
from tasks.scoring.worker import RewardState

if TYPE_CHECKING:
    from tasks.core.config import Config


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c passing (Chen et al., 2021): 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def baseline_metric(store: Store, cfg: Config) -> float | None:
    """The starting model's `eval.metric` (eval.baseline), or None when it was not evaluated."""
    found = store.manifest(layout.evaluation(cfg.run.name, 0)) if cfg.eval.baseline else None
    return found["meta"]["metrics"].get(cfg.eval.metric_key()) if found else None


def _update_best(store: Store, cfg: Config, iteration: int, metrics: dict) -> None:
    run, name = cfg.run.name, cfg.eval.metric_key()
    if iteration == 0:
        return                                       # the base model is the bar, never BEST itself
    current, best = store.get_pointer(layout.best(run)), None
    if current is not None:
        if (best_iter := layout.version_of(current)) == iteration:
            return
        found = store.manifest(layout.evaluation(run, best_iter))
        best = found["meta"]["metrics"][name] if found is not None else None
    if name in metrics and improves(metrics[name], best, baseline_metric(store, cfg)):
        store.set_pointer(layout.best(run), layout.policy(run, iteration))


def _scored_before(cfg: Config, store: Store, iteration: int) -> bool:
    """Whether the run's evaluation before v`iteration` (eval.every's schedule; v0 with eval.baseline) has its
    eval.metric: the functions have scored the evaluation's prompts, so an evaluation whose every score failed
    now may be a passing fault (a judge's network) and is skipped with a warning when reward.strict is off, as
    an iteration's rewards are (require_some_score); two in a row stop the run."""
    every = cfg.eval.every
    if iteration <= 0 or not every:
        return False
    before = (iteration - 1) // every * every
    if before == 0 and not cfg.eval.baseline:
        return False
    found = store.manifest(layout.evaluation(cfg.run.name, before))
    return found is not None and cfg.eval.metric_key() in found["meta"].get("metrics", {})


def _passes(cfg: Config, records: list, n_prompts: int) -> list[int]:
    """Per prompt, how many of its completions pass (eval.pass_reward's score or the combined reward, at least
    eval.pass_threshold)."""
    passed = [0] * n_prompts
    for r in records:
        score = r.reward if cfg.eval.pass_reward is None else r.rewards.get(cfg.eval.pass_reward)
        passed[r.group] += int(score is not None and score >= cfg.eval.pass_threshold)
    return passed


def format_metrics(cfg: Config, records: list) -> dict[str, float]:
    """eval.format_reward: the share of greedy answers in the asked form, and the accuracy among those (a gain
    in form alone raises the first, not the second; with no answer in form, no such accuracy: not a 0)."""
    formatted = [r for r in records if (r.rewards.get(cfg.eval.format_reward) or 0.0) >= 1.0]
    passed = _passes(cfg, formatted, max((r.group for r in records), default=-1) + 1)
    return {"eval/greedy_format_share": len(formatted) / max(len(records), 1),
            **({"eval/greedy_pass_at_1_formatted": sum(passed) / len(formatted)} if formatted else {})}


def scoring_metrics(prefix: str, scored: Scored, own: dict[str, float]) -> dict[str, float]:
    """A pass's scoring as the reward stage logs an iteration's, under the pass's `prefix` (eval/ for the sampled
    pass, eval/greedy_ for the greedy one): each function's <fn>/errors (1: a call failed) and <fn>/nan, and what
    the functions logged with log_metric (TRL logs them in eval mode too); a logged name that comes out as one of
    `own` (the eval's metrics: eval/reward_mean ...) is renamed as the reward stage's are (logged_metrics)."""
    out = {f"{prefix}{name}/errors": float(name in scored.errors) for name in scored.scores}
    out.update({f"{prefix}{name}/nan": float(scored.nan.get(name, 0)) for name in scored.scores})
    return {**out, **logged_metrics(scored.metrics, {**own, **out}, prefix)}


def check_named_rewards(cfg: Config, names: list[str], weights: dict[str, float] | None = None) -> None:
    """eval.pass_reward and eval.format_reward name reward functions or models of the run: one line if not. A
    paid format reward (`weights`: the functions') with no pass_reward: one line too, since a pass would then be
    the combined reward, which a well-formed wrong answer can reach."""
    for field in ("pass_reward", "format_reward"):
        name = getattr(cfg.eval, field)
        if name is not None and name not in names:
            raise UserError(f"eval.{field}: {name!r} is not one of the reward functions or models "
                            f"({', '.join(names)})")
    fmt = cfg.eval.format_reward
    if fmt is not None and cfg.eval.pass_reward is None and (weights or {}).get(fmt, 0.0) != 0.0:
        raise UserError(f"eval.pass_reward: unset with eval.format_reward {fmt!r} paid (weight "
                        f"{weights[fmt]:g}), so a pass would be the combined reward, which a well-formed wrong answer "
                        f"can reach; expected the reward function that scores correctness alone")


def evaluate(cfg: Config, iteration: int, services: Services | None = None) -> dict:
    """Evaluate published policy v`iteration` (0: the starting model); returns {key, uri, metrics}. `services`:
    the stage's context (its servers; None: what this process's environment says)."""
    store = open_store(cfg)
    ec = cfg.eval
    key = layout.evaluation(cfg.run.name, iteration)
    if iteration == 0:                          # eval.baseline: the starting model
        policy, weights = layout.BASE, cfg.section_hash("model")
    else:
        policy = layout.policy(cfg.run.name, iteration)
        pm = require_input(store, cfg, "evaluate", iteration, ("publish", iteration))
        weights = sorted((k, v["sha256"]) for k, v in pm["files"].items())
    fp, made = fingerprint(cfg, ("eval", "reward", "data", *cfg.env_sections()), iteration=iteration,
                           policy=weights)
    done = reuse(store, key, fp, made)
    if done is None:
        t0 = time.perf_counter()
        functions = load_functions(cfg)
        check_named_rewards(cfg, functions.all_names, functions.weights)
        ds = data.load_prompts(cfg, split="eval")
        rows = list(range(min(ec.max_prompts, len(ds))))
        seed = cfg.run.seed * 1_000_003 + 500_000_000 + iteration
        state = RewardState(global_step=iteration, max_steps=cfg.run.iterations)
        services = Services.given(services)
        source = source_of(cfg)
        pictured = ec.screenshots > 0 and takes_screenshots(cfg)     # (the greedy pass, else the sampled one)
        shot = with_screenshots(cfg) if pictured else cfg
        with open_session(cfg, policy, services) as session:         # one model load / engine start for both passes
            what = f"the evaluation of v{iteration:06d}"
            records, cache = [], layout.judge_cache(cfg.run.name, iteration, "evaluate")
            passes: list[tuple[str, Scored]] = []           # (each pass's metrics' prefix, what its scoring said)
            skippable = not cfg.reward.strict and _scored_before(cfg, store, iteration)
            if ec.num_generations:                        # (0: the greedy pass alone)
                records, _ = source.run(cfg if ec.greedy else shot, session, ds, rows, SamplingParams(
                    n=ec.num_generations, max_new_tokens=cfg.generate.max_completion_length,
                    temperature=ec.temperature or cfg.generate.temperature, top_p=cfg.generate.top_p,
                    top_k=cfg.generate.top_k, seed=seed), policy, services)
                source.require_some(cfg, records, what)   # (no score of 0 recorded, nor a champion gated on it)
                scored = score_records(functions, records, cfg.reward.aggregate, state, judge_cache=cache,
                                       services=services)
                require_some_score(records, scored, what, skippable=skippable)
                passes.append(("eval/", scored))
            greedy = []
            if ec.greedy:
                greedy, _ = source.run(shot, session, ds, rows, SamplingParams(
                    n=1, max_new_tokens=cfg.generate.max_completion_length, temperature=0.0, top_p=1.0,
                    seed=seed), policy, services)
                source.require_some(cfg, greedy, f"{what} (greedy)")
                scored = score_records(functions, greedy, cfg.reward.aggregate, state, judge_cache=cache,
                                       services=services)
                require_some_score(greedy, scored, f"{what} (greedy)", skippable=skippable)
                passes.append(("eval/greedy_", scored))
            routed = session.metrics("eval")               # generate.replicas: per replica, the router's counts
        # per episode: an agent's step-wise samples after its first (Rollout.part > 0) are not counted again
        episodes, greedy_episodes = ([r for r in recs if not r.part] for recs in (records, greedy))
        metrics = {}
        # a pass whose every score failed (skipped: see _scored_before) has no numbers: not 0s that read as scores
        sampled = bool(ec.num_generations) and any(r.reward is not None for r in episodes)
        greedy_scored = ec.greedy and any(r.reward is not None for r in greedy_episodes)
        if unscored := (bool(ec.num_generations) and not sampled) + (ec.greedy and not greedy_scored):
            metrics["eval/unscored_passes"] = float(unscored)
        if sampled:
            passed = _passes(cfg, episodes, len(rows))
            present = [r.reward for r in episodes if r.reward is not None]
            metrics.update({"eval/reward_mean": sum(present) / max(len(present), 1),
                            f"eval/pass_at_{ec.k}": sum(pass_at_k(ec.num_generations, c, ec.k) for c in passed)
                            / len(rows)})
        if greedy_scored:
            metrics["eval/greedy_pass_at_1"] = sum(_passes(cfg, greedy_episodes, len(rows))) / len(rows)
            lead = [r.reward for r in greedy_episodes if r.reward is not None]
            metrics["eval/greedy_reward_mean"] = sum(lead) / max(len(lead), 1)
            if ec.format_reward is not None:
                metrics.update(format_metrics(cfg, greedy_episodes))
        metrics.update({"eval/prompts": float(len(rows)), "eval/seconds": time.perf_counter() - t0, **routed})
        with tempfile.TemporaryDirectory(prefix="rlflow-eval-") as tmp:
            if pictured:
                metrics["eval/screens_episodes"] = float(file_frames(greedy or records, Path(tmp), ec.screenshots))
            for prefix, scored in passes:
                metrics.update(scoring_metrics(prefix, scored, metrics))
            rollout.write(records, Path(tmp))
            if greedy:
                (Path(tmp) / layout.GREEDY).mkdir()
                rollout.write(greedy, Path(tmp) / layout.GREEDY)
            meta = {"fingerprint": fp, "made_of": made, "metrics": metrics}
            done = result(store, key, store.put_folder(key, Path(tmp), meta=meta))
    _update_best(store, cfg, iteration, done["metrics"])
    return done


if __name__ == "__main__":
    stage_cli(evaluate, "evaluate", takes_services=True)

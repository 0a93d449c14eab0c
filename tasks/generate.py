"""Stage 1 — generate: sample `num_generations` completions for each of this iteration's prompts.

    python -m tasks.generate --config configs/tiny.yaml --iteration 3 [--policy base|<store key of a policy>]
                                                                      [--round R]   (generate.dynamic_sampling)

Reads the policy the schedule names for iteration N, v(N-1-S) with S = run.max_staleness (the base model
before iteration S+2; tasks/core/layout.py: behaviour_policy), and the dataset; writes `<run>/iter-N/rollouts`
(token ids, text, behaviour logprobs, truncation flag). A policy passed in that is not the schedule's is
refused (the version check). Which prompts: tasks/core/curriculum.py.
Idempotent: if that folder is complete and was made from the same inputs, it is returned as is.
The engine is the one `generate.engine` / `generate.mode` name (tasks/engines/sampling.py's factory); with
env.factory each rollout is a multi-turn episode against an environment (tasks/envs/runtime/episodes.py).
More: docs/internals.md (tasks/generate.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import curriculum, data, layout, rollout
from tasks.core.contracts import SamplingParams
from tasks.core.errors import UserError
from tasks.core.placement import Services
from tasks.core.stage import check_round, fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import open_store
from tasks.engines.sampling import open_session
from tasks.envs.runtime.sources import source_of

if TYPE_CHECKING:
    from tasks.core.config import Config


def generate(cfg: Config, iteration: int, policy: str | None = None, round: int = 0,
             services: Services | None = None) -> dict:
    """Sample completions for iteration `iteration` (dynamic sampling's round `round`) from the policy the schedule
    names (`policy`, if given, must be that one); returns {key, uri, metrics}. `services`: the stage's context
    (tasks/core/placement.py; None: what this process's environment says)."""
    check_round(cfg, round)
    S = cfg.run.max_staleness
    scheduled = layout.behaviour_policy(cfg.run.name, iteration, S)
    if policy is not None and policy != scheduled:
        which = "the base model" if scheduled == layout.BASE else f"v(N-1-S), published by iteration " \
                                                                  f"{layout.version_of(scheduled)}"
        raise UserError(f"--policy: iteration {iteration} samples from {scheduled} (run.max_staleness {S}: "
                        f"{which}), not {policy}")
    policy = scheduled
    store = open_store(cfg)
    key = layout.rollouts(cfg.run.name, iteration, round)
    fp, made = fingerprint(cfg, ("model", "data", "generate", *cfg.env_sections()), iteration=iteration,
                           policy=policy, **({"round": round} if round else {}))
    if (done := reuse(store, key, fp, made)) is not None:
        return done
    if policy != layout.BASE:                  # published by an earlier iteration: that one first
        require_input(store, cfg, "generate", iteration, ("publish", layout.version_of(policy)))

    t0 = time.perf_counter()
    gc = cfg.generate
    if gc.streaming is not None:                 # the run's streaming sampler picked and sampled them
        records, metrics, rows, picked = _streamed(cfg, iteration, services)
    else:
        ds = data.load_prompts(cfg)
        rows, picked = curriculum.prompts(cfg, store, iteration, round, len(ds))
        records, metrics = _sampled(cfg, iteration, round, ds, rows, policy, services)
    metrics["generate/completion_length"] = sum(len(r.completion_ids) for r in records) / len(records)
    metrics["generate/truncated_share"] = sum(r.truncated for r in records) / len(records)
    metrics["generate/seconds"] = time.perf_counter() - t0
    metrics.update(picked)
    with tempfile.TemporaryDirectory(prefix="rlflow-generate-") as tmp:
        rollout.write(records, Path(tmp))
        manifest = store.put_folder(key, Path(tmp), meta={"fingerprint": fp, "made_of": made, "metrics": metrics,
                                                          "policy": policy, "rows": rows,
                                                          "data_cursor": data.cursor(iteration + 1,
                                                                                     gc.prompts_per_iteration)})
    return result(store, key, manifest)


def _sampled(cfg: Config, iteration: int, round: int, ds, rows: list[int], policy: str,
             services: Services | None) -> tuple[list, dict]:
    """This stage's rollouts, sampled here from `policy` by the configured engine (or source: environments'
    episodes, agents), and their metrics."""
    gc = cfg.generate
    services = Services.given(services)
    source = source_of(cfg)                      # prompts, environments' episodes or agents'
    with open_session(cfg, policy, services) as session:
        records, sampled = source.run(cfg, session, ds, rows, SamplingParams(
            n=gc.num_generations, max_new_tokens=gc.max_completion_length, temperature=gc.temperature,
            top_p=gc.top_p, top_k=gc.top_k, seed=cfg.run.seed * 1_000_003 + iteration + round * ROUND_SEED),
            policy, services)
        routed = session.metrics("generate")        # generate.replicas: per replica, and the router's counts
    source.require_some(cfg, records, f"iteration {iteration}")
    n_tokens = sum(len(r.completion_ids) for r in records)
    metrics = {
        "generate/tokens_per_s": n_tokens / max(sampled.sampling_seconds, 1e-9),
        "generate/load_seconds": session.load_seconds + sampled.load_seconds,   # model load, engine start, reload
        "generate/sampling_seconds": sampled.sampling_seconds,
        "generate/staleness": iteration - 1 - layout.version_of(policy),   # updates the sampler is behind
    }
    metrics.update(routed)
    metrics.update(source.metrics(cfg, records, services))
    return records, metrics


def _streamed(cfg: Config, iteration: int, services: Services | None) -> tuple[list, dict, list[int], dict]:
    """generate.streaming: iteration N's groups from the run's streaming sampler (tasks/engines/streaming.py),
    each token tagged with the policy version that drew it, and their metrics (the staleness of the oldest
    token, the versions' spread, what the sampler did since the last stage); the prompts' rows and what the
    curriculum said of them (the sampler picked them: one picker of the curriculum's state at a time). Its groups
    are the source's (prompts, environments' or agents' episodes: `streamed`), against the services `services`
    names when the sampler starts."""
    from tasks.core.placement import placement_of
    from tasks.engines.streaming import Stream
    from tasks.scoring.streamed import GroupScorer

    listener = (lambda: GroupScorer.start(cfg)) if placement_of(cfg).scores_as_groups_complete() else None
    source = source_of(cfg)
    groups = source.streamed(Services.given(services))
    records, metrics, rows, picked = Stream.of(cfg, iteration, listener, groups, services).collect(iteration)
    source.require_some(cfg, records, f"iteration {iteration}")
    metrics.update(source.metrics(cfg, records, services))
    versions = [v for r in records for v in r.versions or ()]     # (None: an episode that sampled nothing)
    oldest = min(versions, default=iteration - 1)
    metrics.update({
        "generate/staleness": iteration - 1 - oldest,   # its oldest token's
        "generate/versions": float(len(set(versions))),
        "generate/newer_tokens_share": sum(v > oldest for v in versions) / max(len(versions), 1),
    })
    return records, metrics, rows, picked


ROUND_SEED = 7_777_777          # round r of an iteration samples with the iteration's seed + r * ROUND_SEED



if __name__ == "__main__":
    stage_cli(generate, "generate", takes_policy=True, takes_round=True, takes_services=True)

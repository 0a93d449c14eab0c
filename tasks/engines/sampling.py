"""The sampling engines' factory, and sampling a batch of dataset rows into rollouts (what the generate and
evaluate stages share). The contract (SamplingEngine, SamplingSession and their records) is
tasks/core/contracts.py's.

    engine = sampling_engine(cfg)           # hf | vllm offline | vllm server (generate.engine / generate.mode),
                                            # or N of them behind a router (generate.replicas: replicas.py)
    with engine.session(policy, path, tokenizer) as s:      # the policy loaded, or the engine started, once
        sampled = s.sample(prompt_ids, SamplingParams(n=8, ...))       # as many times as the stage needs
    sampled.samples[0]                      # Sample(prompt=0, completion_ids=[...], logprobs=[...], truncated=False)

Every engine returns the same samples, one per completion, prompt by prompt. The sampled tokens' logprobs are
taken after temperature/top-p, i.e. from the distribution actually sampled from, which is what importance
ratios need. The stages never branch on the engine.
More: docs/internals.md (tasks/engines/sampling.py): sessions, and what an engine keeps alive across stages.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.core import data
from tasks.core.contracts import Rollout
from tasks.core.models import base_path, encode_prompt, load_tokenizer, policy_path
from tasks.core.placement import placement_of

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Sampled, SamplingEngine, SamplingParams, SamplingSession
    from tasks.core.placement import Services


def sampling_engine(cfg: Config, services: Services | None = None) -> SamplingEngine:
    """The engine `generate.engine` / `generate.mode` name (vLLM's code is imported only when chosen);
    `services`: the stage's context (how the replicas' router launches them on sky)."""
    if placement_of(cfg).replicas:
        from tasks.engines.replicas import ReplicaEngine
        return ReplicaEngine(cfg, _one_engine(cfg), services.replica_launch if services is not None else None)
    return _one_engine(cfg)


def _one_engine(cfg: Config) -> SamplingEngine:
    if cfg.generate.engine == "hf":
        from tasks.engines.hf import HFEngine
        return HFEngine(cfg)
    if cfg.generate.mode == "resident":
        from tasks.engines.vllm_server import VLLMServer
        return VLLMServer(cfg)
    from tasks.engines.vllm_offline import VLLMOffline
    return VLLMOffline(cfg)


def open_session(cfg: Config, policy: str, services: Services | None = None) -> SamplingSession:
    """The configured engine's session for `policy` (a store key or `base`): what a stage opens once
    (`with open_session(cfg, policy) as s`) and samples from as often as it needs."""
    if placement_of(cfg).replicas:    # the replicas load the policy; the stage only needs its tokenizer
        path = base_path(cfg)
        return sampling_engine(cfg, services).session(policy, path, load_tokenizer(path))
    path = policy_path(cfg, policy)
    return sampling_engine(cfg).session(policy, path, load_tokenizer(path))


def sample_rollouts(cfg: Config, session: SamplingSession, ds, rows: list[int],
                    params: SamplingParams) -> tuple[list[Rollout], Sampled]:
    """Sample completions of dataset rows `rows` from the session's policy, as rollout records (reward fields
    empty): the prompt as the generator saw it, its token ids, the completion's text, ids and behaviour
    logprobs, and the row's other columns (what reward functions get). (Multi-turn episodes:
    tasks/envs/runtime/episodes.py.)"""
    tokenizer = session.tokenizer
    table = {r: ds[r] for r in set(rows)}          # a datasets row access costs ~50 us: once per row
    prompts = [data.prompt_of(cfg, table[r]) for r in rows]
    prompt_ids = [encode_prompt(tokenizer, p, cfg.generate.max_prompt_length) for p in prompts]
    sampled = session.sample(prompt_ids, params)
    records = []
    for s in sampled.samples:
        row = table[rows[s.prompt]]
        records.append(Rollout(group=s.prompt, row=rows[s.prompt], prompt=prompts[s.prompt],
                               prompt_ids=prompt_ids[s.prompt],
                               completion=tokenizer.decode(s.completion_ids, skip_special_tokens=True),
                               completion_ids=s.completion_ids, logprobs=s.logprobs, truncated=s.truncated,
                               columns={k: v for k, v in row.items() if k != cfg.data.prompt_column}))
    return records, sampled

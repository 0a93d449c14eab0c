"""The sampling-engine contract, its factory, and sampling a batch of dataset rows into rollouts (what the
generate and evaluate stages share).

    engine = sampling_engine(cfg)           # hf | vllm offline | vllm server (generate.engine / generate.mode)
    sampled = engine.generate(policy, path, tokenizer, prompt_ids, SamplingParams(n=8, ...))
    sampled.samples[0]                      # Sample(prompt=0, completion_ids=[...], logprobs=[...], truncated=False)

Every engine returns the same samples, one per completion, prompt by prompt. The sampled tokens' logprobs are
taken after temperature/top-p, i.e. from the distribution actually sampled from, which is what importance
ratios need. The stages never branch on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tasks.core import data
from tasks.core.models import encode_prompt, load_tokenizer, policy_path
from tasks.core.rollout import Rollout

if TYPE_CHECKING:
    from tasks.core.config import Config


@dataclass(frozen=True)
class SamplingParams:
    n: int                  # completions per prompt
    max_new_tokens: int
    temperature: float      # 0: greedy (the most likely token; evaluation's greedy pass@1)
    top_p: float
    seed: int               # the whole request's seed: a rerun samples the same tokens


@dataclass(frozen=True)
class Sample:
    """One completion."""

    prompt: int                 # index of its prompt in the request
    completion_ids: list[int]   # includes the EOS token when it stopped on its own
    logprobs: list[float]       # behaviour logprob of each completion token (after temperature / top-p)
    truncated: bool             # hit max_new_tokens without EOS


@dataclass(frozen=True)
class Sampled:
    samples: list[Sample]       # n per prompt, prompt by prompt
    load_seconds: float         # model load, engine start or weight reload
    sampling_seconds: float     # sampling alone


class SamplingEngine(Protocol):
    """Samples completions from a policy: tasks/engines/hf.py, vllm_offline.py, vllm_server.py."""

    def __init__(self, cfg: Config) -> None: ...

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """One UserError line if this machine cannot run the engine (vllm missing)."""

    def generate(self, policy: str, path: str, tokenizer, prompt_ids: list[list[int]],
                 params: SamplingParams) -> Sampled:
        """Sample `params.n` completions of each prompt (token ids) from `policy` (its name: `base` or a store
        key; `path`: its local folder or hub id)."""

    def stop(self, log=print) -> None:
        """Release what the engine keeps alive across stage runs (server mode: the vLLM server); the flow calls
        it at its end. Never raises."""


def sampling_engine(cfg: Config) -> SamplingEngine:
    """The engine `generate.engine` / `generate.mode` name (vLLM's code is imported only when chosen)."""
    if cfg.generate.engine == "hf":
        from tasks.engines.hf import HFEngine
        return HFEngine(cfg)
    if cfg.generate.mode == "server":
        from tasks.engines.vllm_server import VLLMServer
        return VLLMServer(cfg)
    from tasks.engines.vllm_offline import VLLMOffline
    return VLLMOffline(cfg)


def sample_rollouts(cfg: Config, ds, rows: list[int], policy: str,
                    params: SamplingParams) -> tuple[list[Rollout], Sampled]:
    """Sample completions of dataset rows `rows` from `policy`, as rollout records (reward fields empty): the
    prompt as the generator saw it, its token ids, the completion's text, ids and behaviour logprobs, and the
    row's other columns (what reward functions get). (Multi-turn episodes: tasks/envs/episodes.py.)"""
    path = policy_path(cfg, policy)
    tokenizer = load_tokenizer(path)
    table = {r: ds[r] for r in set(rows)}          # a datasets row access costs ~50 us: once per row
    prompts = [data.prompt_of(cfg, table[r]) for r in rows]
    prompt_ids = [encode_prompt(tokenizer, p, cfg.generate.max_prompt_length) for p in prompts]
    sampled = sampling_engine(cfg).generate(policy, path, tokenizer, prompt_ids, params)
    records = []
    for s in sampled.samples:
        row = table[rows[s.prompt]]
        records.append(Rollout(group=s.prompt, row=rows[s.prompt], prompt=prompts[s.prompt],
                               prompt_ids=prompt_ids[s.prompt],
                               completion=tokenizer.decode(s.completion_ids, skip_special_tokens=True),
                               completion_ids=s.completion_ids, logprobs=s.logprobs, truncated=s.truncated,
                               columns={k: v for k, v in row.items() if k != cfg.data.prompt_column}))
    return records, sampled

"""The sampling-engine contract, its factory, and sampling a batch of dataset rows into rollouts (what the
generate and evaluate stages share).

    engine = sampling_engine(cfg)           # hf | vllm offline | vllm server (generate.engine / generate.mode)
    with engine.session(policy, path, tokenizer) as s:      # the policy loaded, or the engine started, once
        sampled = s.sample(prompt_ids, SamplingParams(n=8, ...))       # as many times as the stage needs
    sampled.samples[0]                      # Sample(prompt=0, completion_ids=[...], logprobs=[...], truncated=False)

A session is opened for one policy and kept for every call a stage makes: the sampled and greedy passes of an
evaluation, every turn of an episode (tasks/envs/episodes.py). So an engine loads its model or starts its
engine once per stage, not once per call: offline vLLM starts one worker per session, the hf engine owns the
model it samples from. What an engine keeps alive across stages (the vLLM server; the hf engine's resident
model, loaded in place by the next policy) is released by `stop`, at the flow's end.

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


class SamplingSession(Protocol):
    """One policy held by an engine, sampled from as often as the stage needs, then closed (a context manager:
    `with engine.session(...) as s`). Its `load_seconds` is what opening it took (model load, engine start or
    weight reload); a `sample` reports its own (a reload it needed: another session of the process took the
    model meanwhile, a server restarted)."""

    tokenizer: object           # the policy's tokenizer (what the stage encodes prompts and decodes completions with)
    load_seconds: float

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams) -> Sampled:
        """Sample `params.n` completions of each prompt (token ids)."""

    def close(self) -> None:
        """Release what the session holds (not what the engine keeps across stages). Never raises."""

    def __enter__(self) -> SamplingSession: ...

    def __exit__(self, *exc) -> None: ...


class SamplingEngine(Protocol):
    """Samples completions from a policy: tasks/engines/hf.py, vllm_offline.py, vllm_server.py."""

    def __init__(self, cfg: Config) -> None: ...

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """One UserError line if this machine cannot run the engine (vllm missing)."""

    def session(self, policy: str, path: str, tokenizer) -> SamplingSession:
        """Open `policy` (its name: `base` or a store key; `path`: its local folder or hub id) for sampling."""

    def stop(self, log=print) -> None:
        """Release what the engine keeps alive across stage runs (server mode: the vLLM server; hf: the resident
        model); the flow calls it at its end. Never raises."""


class Session:
    """What every engine's session shares: the context manager around `close`."""

    tokenizer = None
    load_seconds: float = 0.0

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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


def open_session(cfg: Config, policy: str) -> SamplingSession:
    """The configured engine's session for `policy` (a store key or `base`): what a stage opens once
    (`with open_session(cfg, policy) as s`) and samples from as often as it needs."""
    path = policy_path(cfg, policy)
    return sampling_engine(cfg).session(policy, path, load_tokenizer(path))


def sample_rollouts(cfg: Config, session: SamplingSession, ds, rows: list[int],
                    params: SamplingParams) -> tuple[list[Rollout], Sampled]:
    """Sample completions of dataset rows `rows` from the session's policy, as rollout records (reward fields
    empty): the prompt as the generator saw it, its token ids, the completion's text, ids and behaviour
    logprobs, and the row's other columns (what reward functions get). (Multi-turn episodes:
    tasks/envs/episodes.py.)"""
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

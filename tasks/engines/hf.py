"""The `hf` sampling engine: transformers' `generate` in this process, on the CPU or one GPU.

A session's policy is a full model or base + LoRA adapter. A process keeps the last model it loaded (the
resident: what the engine keeps across stages, until `stop`), and a next policy built alike (the same
config.json; an adapter of the same config and base) is loaded into it in place, weights only (an adapter's
alone): what an inline flow's generate does every iteration. A hub id is a session's own. transformers runs user logits
processors *before* its own temperature/top-p warpers, and draws sampled tokens from the process-wide torch
RNG, so one last processor of ours does all of it: applies temperature, top-k and top-p (the trainer's own rule,
tasks/algorithms/logprobs.py: cut, so both sides cut alike), records the log-softmax the
token is drawn from (the behaviour logprob), and draws the token from a generator of the request's own (seeded
with its seed); transformers then runs greedy and takes that token. Nothing else in the process (a trainer
held by the flow, training at the same time on another thread: run.max_staleness) moves or is moved by the
sampling's random stream. A lock makes one sampling at a time per process use the resident. Each prompt's KV
cache is filled once and copied to its n samples (generate.share_prompts), where transformers would run the
prompt n times: ~2.5x faster sampling for the SmolLM2 recipe's 60-token prompts and 8 samples each.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from tasks.algorithms.logprobs import cut
from tasks.core.contracts import Sample, Sampled, SamplingParams, SamplingSession
from tasks.core.models import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    base_path,
    device_for,
    ended_at,
    load_policy,
    stop_token_ids,
)

if TYPE_CHECKING:
    from tasks.core.config import Config


class HFEngine:
    """transformers in this process (tasks/engines/sampling.py: SamplingEngine)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """transformers is rlflow's own dependency: nothing to check."""

    def session(self, policy: str, path: str, tokenizer) -> HFSession:
        return HFSession(self.cfg, path, tokenizer)

    def stop(self, log=print) -> None:
        """Let go of the resident model (the flow's end)."""
        RESIDENT.release()


class HFSession(SamplingSession):
    """One policy: a full model folder or an adapter is loaded into the process's resident model (in place when
    the resident is built alike), and each `sample` checks, under the resident's lock, that it still holds this
    policy (another session on another thread may have loaded its own meanwhile: generate of iteration N+1 and
    evaluate of N overlap with run.max_staleness > 0); a hub id is loaded once, the session's own."""

    def __init__(self, cfg: Config, path: str, tokenizer):
        self.cfg, self.path, self.tokenizer = cfg, path, tokenizer
        self.model = None                     # the session's own model (a hub id); else the resident's
        t0 = time.perf_counter()
        self.identity = _identity(cfg, path)  # (what the resident must hold)
        if self.identity is None:
            self.model = sampler_model(load_policy(cfg, path, device_for(cfg)))
        else:
            with RESIDENT.lock:
                RESIDENT.hold(cfg, path, self.identity)
        self.load_seconds = time.perf_counter() - t0

    def sample(self, prompt_ids: list[list[int]], params: SamplingParams,
               keys: list[str] | None = None) -> Sampled:
        t0 = time.perf_counter()
        with RESIDENT.lock:                   # one sampling at a time per process, as the resident is shared
            model = self.model if self.model is not None else RESIDENT.hold(self.cfg, self.path, self.identity)
            t1 = time.perf_counter()
            samples = hf_generate(model, self.tokenizer, prompt_ids, params, self.cfg.generate.batch_size,
                                  self.cfg.generate.share_prompts)
        return Sampled(samples, load_seconds=t1 - t0, sampling_seconds=time.perf_counter() - t1)

    def close(self) -> None:
        self.model = None


def _identity(cfg: Config, path: str) -> tuple | None:
    """A policy as the resident tells policies apart: (what the model is built as, the weight files it holds:
    their folder, names, mtimes and sizes). A full folder is built as its architecture with our dtype and
    device; a LoRA adapter as its base's identity (the base's files included: another base is another model)
    and its adapter config. None for what is not kept resident (a hub id, or an adapter on one)."""
    folder = Path(path)

    def files() -> tuple:
        found = sorted(folder.glob("*.safetensors"))
        return str(folder.resolve()), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in found)

    if (folder / ADAPTER_CONFIG).exists():
        base = _identity(cfg, base_path(cfg))
        if base is None or not (folder / ADAPTER_WEIGHTS).is_file():
            return None
        return (base, (folder / ADAPTER_CONFIG).read_text()), files()
    if not (folder / "config.json").is_file():
        return None
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)        # (the weights' dtype; we load in ours)
    return (json.dumps(config, sort_keys=True), cfg.model.dtype, str(device_for(cfg))), files()


class Resident:
    """The model this process keeps between sessions, one at a time: a next policy built alike (a full folder
    of the same config.json, or a LoRA adapter of the same config on the same base) is loaded into it in
    place, weights only (an adapter's weights alone, the base's left as they are), which is what an inline
    flow's generate does every iteration (a new model each stage would cost a model build per iteration). What
    the hf engine keeps across stages, as the server mode keeps its vLLM server; `HFEngine.stop` lets go of it."""

    def __init__(self):
        self.lock = threading.Lock()          # held by whoever loads into or samples from the model
        self.model = None
        self.key: tuple | None = None         # what it was built as (_identity)
        self.files: tuple | None = None       # the weight files it holds

    def hold(self, cfg: Config, path: str, identity: tuple):
        """The model, holding the policy at `path` (`identity`: _identity's; the caller holds the lock)."""
        key, files = identity
        if self.model is None or self.key != key:
            return self._build(cfg, path, key, files)
        if self.files == files:              # the same files again (each sample of a session): nothing to copy
            return self.model
        self.files = None                    # (a copy that fails half way holds no policy)
        copied = (_copy_adapter if (Path(path) / ADAPTER_CONFIG).exists() else _copy_weights)(
            self.model, Path(path), files, device_for(cfg))
        if not copied:                       # a tensor we do not have, or one the folder does not set
            return self._build(cfg, path, key, files)
        self.files = files
        return self.model

    def _build(self, cfg: Config, path: str, key: tuple, files: tuple):
        self.model = None                                  # (the old one's memory first)
        self.model, self.key, self.files = sampler_model(load_policy(cfg, path, device_for(cfg))), key, files
        return self.model

    def release(self) -> None:
        with self.lock:
            self.model = self.key = self.files = None


def _copy_weights(model, folder: Path, files: tuple, device) -> bool:
    """A full folder's weights copied into `model` in place; False (nothing copied) unless the folder sets
    every tensor of the model and no other."""
    from safetensors.torch import load_file

    state = model.state_dict()
    shards = [load_file(folder / name, device=str(device)) for name, _, _ in files[1]]
    names = {name for weights in shards for name in weights}
    covered = {state[name].untyped_storage().data_ptr() for name in names if name in state}
    if names - state.keys() or {t.untyped_storage().data_ptr() for t in state.values()} - covered:
        return False
    with torch.no_grad():
        for weights in shards:
            for name, tensor in weights.items():
                state[name].copy_(tensor)
    return True


def _copy_adapter(model, folder: Path, files: tuple, device) -> bool:
    """An adapter's weights copied into the resident PeftModel in place (peft's own loader, the base untouched);
    False (nothing copied) unless the file sets every adapter tensor of the model and no other."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(folder / ADAPTER_WEIGHTS, device=str(device))
    if set(weights) != set(get_peft_model_state_dict(model)):
        return False
    with torch.no_grad():
        set_peft_model_state_dict(model, weights)
    return True


RESIDENT = Resident()


class Interruption(Protocol):
    """A newer policy for sequences in flight (issue 42: interruption, not abortion). `pending` is asked after
    each decode step; when it says yes, the in-flight sequences stop there (the token just drawn kept), `apply`
    loads the new policy into the model (in place) and returns the model and the new policy's version, and the
    sequences continue from their partial tokens under it: their prompts and tokens so far are filled into a
    fresh KV cache by the new weights, so every later token and logprob is exactly the new policy's. Nothing
    decoded is thrown away."""

    def pending(self) -> bool: ...
    def apply(self, model) -> tuple[object, int]: ...


class _Interrupted(Exception):
    """The recorder stopped generate at a step where an interruption was pending."""


class _SampleAndRecord:
    """Logits processor placed last (transformers then runs greedy): applies temperature/top-p, draws the
    token from the request's own generator, and returns scores that leave only that token; it remembers the
    log-softmax so the next call (which sees the token drawn) can record that token's logprob. One step of
    (N, vocab) is held at a time, never the whole (steps, N, vocab) score history. The draw is transformers'
    own (softmax, multinomial) on a private generator: the same tokens its sampling gives from the global RNG
    seeded alike. With an `interrupt` pending after a step, it keeps the sequences and stops generate."""

    def __init__(self, temperature: float | torch.Tensor, top_p: float | torch.Tensor, generator: torch.Generator,
                 top_k: int = 0, interrupt: Interruption | None = None):
        # (tensors (N, 1): each row's own, never greedy; a float 0: evaluation's greedy pass@1, no draw)
        self.greedy = not isinstance(temperature, torch.Tensor) and temperature == 0
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = generator
        self.interrupt = interrupt
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.sequences: torch.Tensor | None = None      # interrupted: the sequences, the token just drawn included

    def _collect(self, input_ids):
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1).float().cpu())

    def __call__(self, input_ids, scores):
        self._collect(input_ids)
        if not self.greedy:
            scores = cut(scores / self.temperature, self.top_k, self.top_p)
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        if self.greedy:
            token = scores.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=self.generator)
        if self.interrupt is not None and self.interrupt.pending():
            self.sequences = torch.cat([input_ids, token], dim=-1)
            raise _Interrupted
        return torch.full_like(scores, -torch.inf).scatter_(-1, token, 0.0)

    def logprobs(self, sequences) -> torch.Tensor:
        """The sampled tokens' logprobs (N, steps), the last step's collected from `sequences`."""
        self._collect(sequences)
        return torch.stack(self.steps, dim=1)  # (N, steps)


def _prefill(model, ids: torch.Tensor, attn: torch.Tensor, rows_of: list[int], partial: int):
    """The KV cache of each prompt (`ids`: left-padded, one per prompt) computed once and selected for each row
    (`rows_of`: the prompt of each row), or None when no prompt has two rows (nothing to share). With no partial
    tokens it stops before the prompt's last token (`generate` starts from that one); rows that continue partial
    tokens (an interruption) get their whole prompt cached and `generate` fills in their tokens so far.
    transformers' own expansion repeats each prompt n times before the prefill, which with prompts of ~60 tokens
    and completions of ~16 is most of the sampling's work (the same positions as generate gives them: pads count
    as 1, masked)."""
    used = sorted(set(rows_of))
    cut = ids.shape[1] - (0 if partial else 1)
    if len(used) == len(rows_of) or cut < 1:
        return None
    ids, attn = ids[used], attn[used]
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
    cache = model(input_ids=ids[:, :cut], attention_mask=attn[:, :cut], position_ids=positions[:, :cut],
                  use_cache=True, logits_to_keep=1).past_key_values
    where = {prompt: i for i, prompt in enumerate(used)}
    cache.batch_select_indices(torch.tensor([where[r] for r in rows_of], device=ids.device))
    return cache


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], params: SamplingParams,
                batch_size: int, share_prompts: bool = True, interrupt: Interruption | None = None,
                version: int = 0) -> list[Sample]:
    """params.n samples per prompt, `batch_size` prompts per `model.generate` call. `interrupt`: a newer policy
    may come while they decode (Interruption); each sample's tokens then carry the version that drew them
    (Sample.versions; `version`: the model's at the start)."""
    n, seed = params.n, params.seed
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.manual_seed(seed)
    out = []
    state = {"model": model, "version": version}
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        rows_of = [i for i in range(len(chunk)) for _ in range(n)]
        rows = _decode(state, tokenizer, chunk, rows_of, [[] for _ in rows_of], params.max_new_tokens, params,
                       generator, share_prompts, interrupt)
        for j, (toks, logps, versions, truncated) in enumerate(rows):
            out.append(Sample(start + j // n, toks, logps, truncated,
                              versions if interrupt is not None else None))
    return out


def sampler_model(model):
    """A model this engine samples from, in eval mode, with a generation_config of transformers' defaults (its
    special tokens kept): `generate` fills what a call leaves unset from the model's generation_config.json, so a
    repetition_penalty, min_new_tokens or suppressed tokens shipped with the model (Qwen2.5-Instruct's
    repetition_penalty 1.05-1.1) would shape the tokens before rlflow's processor draws them, and the behaviour
    logprobs would be of a distribution the trainer never computes (vLLM: generation_config="vllm" likewise)."""
    from transformers import GenerationConfig

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model     # (peft: generate is its base's)
    kept = {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if (v := getattr(inner.generation_config, k, None)) is not None}
    inner.generation_config = GenerationConfig(**kept)
    return model.eval()


def _decode(state: dict, tokenizer, prompts: list[list[int]], rows_of: list[int], partials: list[list[int]],
            max_new_tokens: int, params: SamplingParams, generator: torch.Generator, share_prompts: bool,
            interrupt: Interruption | None) -> list[tuple]:
    """One `model.generate` call: row r continues prompt `rows_of[r]` after its tokens so far `partials[r]` (all
    of one length: none at first), for up to `max_new_tokens` more; (tokens, logprobs, versions, truncated) per
    row, in order. Interrupted, the unfinished rows continue (here, recursively) under the new policy."""
    from transformers import GenerationConfig, LogitsProcessorList

    model = state["model"]
    device = next(model.parameters()).device
    stops = stop_token_ids(tokenizer)     # (every EOS of the model's generation_config, as TRL's generate stops)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=stops or None)
    L, k = max(len(p) for p in prompts), len(partials[0])
    base = torch.tensor([[tokenizer.pad_token_id] * (L - len(p)) + p for p in prompts], device=device)
    base_attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    recorder = _SampleAndRecord(params.temperature, params.top_p, generator, params.top_k, interrupt)
    with torch.no_grad():
        cache = _prefill(model, base, base_attn, rows_of, k) if share_prompts else None   # each prompt once
        index = torch.tensor(rows_of, device=device)
        ids = torch.cat([base[index], torch.tensor(partials, dtype=base.dtype, device=device).view(len(rows_of), k)],
                        dim=1)
        attn = torch.cat([base_attn[index], torch.ones(len(rows_of), k, dtype=base_attn.dtype, device=device)], dim=1)
        try:
            seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg,
                                  past_key_values=cache, logits_processor=LogitsProcessorList([recorder]))
            interrupted = False
        except _Interrupted:
            seqs, interrupted = recorder.sequences, True
    logps = recorder.logprobs(seqs)
    completions = seqs[:, L + k:].cpu()
    rows, resume = [], []
    for j in range(completions.shape[0]):
        toks = completions[j].tolist()
        stop = ended_at(toks, stops)
        toks = toks[:stop] if stop else toks
        rows.append([toks, logps[j, :len(toks)].tolist(), [state["version"]] * len(toks),
                     stop is None and len(toks) >= max_new_tokens])
        if interrupted and stop is None and len(toks) < max_new_tokens:
            resume.append(j)
    if interrupted:
        state["model"], state["version"] = interrupt.apply(model)
        if resume:       # (interrupted at one step: every unfinished row has the same number of tokens so far)
            tails = _decode(state, tokenizer, prompts, [rows_of[j] for j in resume],
                            [partials[j] + rows[j][0] for j in resume], max_new_tokens - len(rows[resume[0]][0]),
                            params, generator, share_prompts, interrupt)
            for j, (toks, lp, versions, truncated) in zip(resume, tails, strict=True):
                rows[j] = [rows[j][0] + toks, rows[j][1] + lp, rows[j][2] + versions, truncated]
    return [tuple(r) for r in rows]

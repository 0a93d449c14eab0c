"""The `hf` sampling engine: transformers' `generate` in this process, on the CPU or one GPU.

The policy of each call is a full model or base + LoRA adapter. A process keeps the last full model it
loaded, and a next policy of the same architecture (the same config.json) is loaded into it in place, weights
only: what an inline flow's generate does every iteration. transformers runs user logits
processors *before* its own temperature/top-p warpers, and draws sampled tokens from the process-wide torch
RNG, so one last processor of ours does all of it: applies temperature and top-p, records the log-softmax the
token is drawn from (the behaviour logprob), and draws the token from a generator of the request's own (seeded
with its seed); transformers then runs greedy and takes that token. Nothing else in the process (a trainer
held by the flow, training at the same time on another thread: run.max_staleness) moves or is moved by the
sampling's random stream. A lock makes one generate at a time per process use the kept model. Each prompt's KV
cache is filled once and copied to its n samples (generate.share_prompts), where transformers would run the
prompt n times: ~2.5x faster sampling for the SmolLM2 recipe's 60-token prompts and 8 samples each.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.core.models import ADAPTER_CONFIG, device_for, load_policy
from tasks.engines.sampling import Sample, Sampled, SamplingParams

if TYPE_CHECKING:
    from tasks.core.config import Config


class HFEngine:
    """transformers in this process (tasks/engines/sampling.py: SamplingEngine)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """transformers is rlflow's own dependency: nothing to check."""

    def generate(self, policy: str, path: str, tokenizer, prompt_ids: list[list[int]],
                 params: SamplingParams) -> Sampled:
        t0 = time.perf_counter()
        with _KEPT_LOCK:            # generate of iteration N+1 and evaluate of N may overlap on two threads
            model = _load(self.cfg, path)
            t1 = time.perf_counter()
            samples = hf_generate(model, tokenizer, prompt_ids, params, self.cfg.generate.batch_size,
                                  self.cfg.generate.share_prompts)
        return Sampled(samples, load_seconds=t1 - t0, sampling_seconds=time.perf_counter() - t1)

    def stop(self, log=print) -> None:
        """Nothing outlives a call."""


_kept: dict = {}          # the last full model this process loaded, with the key of its architecture
_loaded: dict = {}        # that key -> the files its weights are from (folder, names, mtimes, sizes)
_KEPT_LOCK = threading.Lock()


def _load(cfg: Config, path: str):
    """The policy at `path`, evaluating: into the kept model, in place, when it has the same architecture."""
    from safetensors.torch import load_file

    folder, device = Path(path), device_for(cfg)
    if (folder / ADAPTER_CONFIG).exists() or not (folder / "config.json").is_file():
        return load_policy(cfg, path, device).eval()                 # adapters, hub ids: as they come
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)        # (the weights' dtype; we load in ours)
    key = (json.dumps(config, sort_keys=True), cfg.model.dtype, str(device))
    files = sorted(folder.glob("*.safetensors"))
    stamp = (str(folder.resolve()), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files))
    model = _kept.get(key)
    if model is None:
        _kept.clear()
        model = _kept[key] = load_policy(cfg, path, device).eval()
        _loaded[key] = stamp
        return model
    if _loaded.get(key) == stamp:      # the same files again (the turns of an episode): nothing to copy
        return model
    _loaded[key] = stamp
    state = model.state_dict()
    shards = [load_file(shard, device=str(device)) for shard in files]
    names = {name for weights in shards for name in weights}
    covered = {state[name].untyped_storage().data_ptr() for name in names if name in state}
    if names - state.keys() or {t.untyped_storage().data_ptr() for t in state.values()} - covered:
        _kept.clear()                      # a tensor we do not have, or one the folder does not set: afresh
        model = _kept[key] = load_policy(cfg, path, device).eval()
        _loaded[key] = stamp
        return model
    with torch.no_grad():
        for weights in shards:
            for name, tensor in weights.items():
                state[name].copy_(tensor)
    return model


class _SampleAndRecord:
    """Logits processor placed last (transformers then runs greedy): applies temperature/top-p, draws the
    token from the request's own generator, and returns scores that leave only that token; it remembers the
    log-softmax so the next call (which sees the token drawn) can record that token's logprob. One step of
    (N, vocab) is held at a time, never the whole (steps, N, vocab) score history. The draw is transformers'
    own (softmax, multinomial) on a private generator: the same tokens its sampling gives from the global RNG
    seeded alike."""

    def __init__(self, temperature: float, top_p: float, generator: torch.Generator):
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        self.greedy = temperature == 0          # (evaluation's greedy pass@1): the most likely token, no draw
        self.warpers = [] if self.greedy else [TemperatureLogitsWarper(temperature)]
        if top_p < 1.0 and not self.greedy:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.generator = generator
        self.prev: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def _collect(self, input_ids):
        if self.prev is not None:
            self.steps.append(self.prev.gather(-1, input_ids[:, -1:]).squeeze(-1).float().cpu())

    def __call__(self, input_ids, scores):
        self._collect(input_ids)
        for w in self.warpers:
            scores = w(input_ids, scores)
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        if self.greedy:
            token = scores.argmax(dim=-1, keepdim=True)
        else:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            token = torch.multinomial(probs, num_samples=1, generator=self.generator)
        return torch.full_like(scores, -torch.inf).scatter_(-1, token, 0.0)

    def finish(self, sequences) -> torch.Tensor:
        self._collect(sequences)
        return torch.stack(self.steps, dim=1)  # (N, steps)


def _prefill(model, ids: torch.Tensor, attn: torch.Tensor, n: int):
    """The KV cache of each prompt but its last token, computed once and repeated for its n samples (None when
    there is nothing to share): `generate` then starts from the last prompt token. transformers' own expansion
    repeats each prompt n times before the prefill, which with prompts of ~60 tokens and completions of ~16 is
    most of the sampling's work (the same positions as generate gives them: pads count as 1, masked)."""
    if n < 2 or ids.shape[1] < 2:
        return None
    positions = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 1)
    cache = model(input_ids=ids[:, :-1], attention_mask=attn[:, :-1], position_ids=positions[:, :-1], use_cache=True,
                  logits_to_keep=1).past_key_values
    cache.batch_repeat_interleave(n)
    return cache


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], params: SamplingParams,
                batch_size: int, share_prompts: bool = True) -> list[Sample]:
    """params.n samples per prompt, `batch_size` prompts per `model.generate` call."""
    from transformers import GenerationConfig, LogitsProcessorList

    n, temperature, top_p, seed = params.n, params.temperature, params.top_p, params.seed
    max_new_tokens = params.max_new_tokens
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=eos)
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    out = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[tokenizer.pad_token_id] * (L - len(p)) + p for p in chunk], device=device)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.no_grad():
            cache = _prefill(model, ids, attn, n) if share_prompts else None       # each prompt once, not n times
            ids, attn = ids.repeat_interleave(n, dim=0), attn.repeat_interleave(n, dim=0)   # as transformers expands
            recorder = _SampleAndRecord(temperature, top_p, generator)
            seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg, past_key_values=cache,
                                  logits_processor=LogitsProcessorList([recorder]))
        logps = recorder.finish(seqs)
        completions = seqs[:, L:].cpu()
        for j in range(completions.shape[0]):
            toks = completions[j].tolist()
            stop = toks.index(eos) + 1 if eos in toks else None
            toks = toks[:stop] if stop else toks
            out.append(Sample(start + j // n, toks, logps[j, :len(toks)].tolist(), truncated=stop is None))
    return out

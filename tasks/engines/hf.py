"""The `hf` sampling engine: transformers' `generate` in this process, on the CPU or one GPU.

The policy is loaded for each call (a full model, or base + LoRA adapter). transformers runs user logits
processors *before* its own temperature/top-p warpers, so sampling is asked for at temperature 1 / top-p 1 and
one last processor of ours applies both and records the log-softmax the token was drawn from (the behaviour
logprob), one step at a time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from tasks.core.models import device_for, load_policy
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
        model = load_policy(self.cfg, path, device_for(self.cfg)).eval()
        t1 = time.perf_counter()
        samples = hf_generate(model, tokenizer, prompt_ids, params, self.cfg.generate.batch_size)
        return Sampled(samples, load_seconds=t1 - t0, sampling_seconds=time.perf_counter() - t1)

    def stop(self, log=print) -> None:
        """Nothing outlives a call."""


class _SampleAndRecord:
    """Logits processor placed last: applies temperature/top-p itself, then remembers the log-softmax so
    the next call (which sees the token just sampled) can record that token's logprob. One step of
    (N, vocab) is held at a time, never the whole (steps, N, vocab) score history."""

    def __init__(self, temperature: float, top_p: float):
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(temperature)]
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
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
        return scores

    def finish(self, sequences) -> torch.Tensor:
        self._collect(sequences)
        return torch.stack(self.steps, dim=1)  # (N, steps)


def hf_generate(model, tokenizer, prompt_ids: list[list[int]], params: SamplingParams,
                batch_size: int) -> list[Sample]:
    """params.n samples per prompt, `batch_size` prompts per `model.generate` call."""
    from transformers import GenerationConfig, LogitsProcessorList

    n, temperature, top_p, seed = params.n, params.temperature, params.top_p, params.seed
    max_new_tokens = params.max_new_tokens
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens,
                               num_return_sequences=n, pad_token_id=tokenizer.pad_token_id, eos_token_id=eos)
    torch.manual_seed(seed)
    out = []
    for start in range(0, len(prompt_ids), batch_size):
        chunk = prompt_ids[start:start + batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[tokenizer.pad_token_id] * (L - len(p)) + p for p in chunk], device=device)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk], device=device)
        recorder = _SampleAndRecord(temperature, top_p)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([recorder]))
        logps = recorder.finish(seqs)
        completions = seqs[:, L:].cpu()
        for j in range(completions.shape[0]):
            toks = completions[j].tolist()
            stop = toks.index(eos) + 1 if eos in toks else None
            toks = toks[:stop] if stop else toks
            out.append(Sample(start + j // n, toks, logps[j, :len(toks)].tolist(), truncated=stop is None))
    return out

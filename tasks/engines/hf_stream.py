"""The hf engine's side of generate.streaming (tasks/engines/streaming.py: Stream): continuous batching on
transformers' `generate`, and the decoder that holds the run's resident policy (loaded in place). The vLLM
engine's twin: tasks/engines/vllm_stream.py.

    decoder = HFDecoder(cfg, params)          # what Stream decodes with (streaming.decoder_of picks it)
    decoder.load(key, path); decoder.step_batch(rows, version, stop)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tasks.core.contracts import SamplingParams
from tasks.core.models import ended_at, load_tokenizer, stop_token_ids
from tasks.engines.hf import RESIDENT, _identity, _Interrupted, _prefill, _SampleAndRecord

if TYPE_CHECKING:
    from tasks.core.config import Config


class ContinuousSampler:
    """Continuous batching on transformers' `generate`: `step_batch(model, rows, version, stop)` decodes the
    rows until all have finished, or `stop(finished, rows)` says so after a decode step (then the rows keep their
    tokens, the one just drawn included, and the caller may add rows, drop the finished ones and load another
    policy before the next call). Rows of one prompt share its KV cache; each row's tokens so far are filled in
    after it, so rows that joined at different times decode in one batch (pads between prompt and tokens are
    masked; positions skip them, as transformers' own left padding does)."""

    def __init__(self, tokenizer, params: SamplingParams, max_new_tokens: int, share_prompts: bool = True):
        self.tokenizer, self.params, self.limit, self.share = tokenizer, params, max_new_tokens, share_prompts
        self.generator: torch.Generator | None = None

    def step_batch(self, model, rows: list, version: int, stop) -> bool:     # (rows: streaming.Row)
        """Decode `rows` (unfinished) once under `model` (policy `version`); True when `stop` ended it early."""
        from transformers import GenerationConfig, LogitsProcessorList

        device = next(model.parameters()).device
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.params.seed)
        tok, stops = self.tokenizer, stop_token_ids(self.tokenizer)
        index: dict[tuple, int] = {}
        rows_of = [index.setdefault(tuple(r.prompt), len(index)) for r in rows]
        prompts = [list(p) for p in index]
        L, K = max(len(p) for p in prompts), max(len(r.tokens) for r in rows)
        base = torch.tensor([[tok.pad_token_id] * (L - len(p)) + p for p in prompts], device=device)
        base_attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
        # each row: its prompt but the last token (cached once per prompt), pads, the prompt's last token and the
        # row's tokens so far, so every row's last column is a real token whatever its length
        tails = [[tok.pad_token_id] * (K - len(r.tokens)) + [prompts[p][-1]] + r.tokens for r, p in zip(rows, rows_of)]
        tail_attn = [[0] * (K - len(r.tokens)) + [1] * (1 + len(r.tokens)) for r in rows]
        at = torch.tensor(rows_of, device=device)
        ids = torch.cat([base[at, :L - 1], torch.tensor(tails, device=device)], dim=1)
        attn = torch.cat([base_attn[at, :L - 1], torch.tensor(tail_attn, device=device)], dim=1)
        budget = min((self.limit if r.limit is None else r.limit) - len(r.tokens) for r in rows)
        watch = _Finished(ids.shape[1], stops, stop, device)
        temperature, top_p = self.params.temperature, self.params.top_p
        if any(r.sampling for r in rows):          # rows at their own settings: one per row
            temperature, top_p = (torch.tensor(v, device=device).unsqueeze(-1)
                                  for v in zip(*(r.settings(self.params) for r in rows)))
        recorder = _SampleAndRecord(temperature, top_p, self.generator, self.params.top_k, watch)
        gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=budget, pad_token_id=tok.pad_token_id,
                                   eos_token_id=stops or None)
        with torch.no_grad():
            cache = _prefill(model, base, base_attn, rows_of, 0) if self.share else None
            try:
                seqs, stopped = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg,
                                               past_key_values=cache,
                                               logits_processor=LogitsProcessorList([watch, recorder])), False
            except _Interrupted:
                seqs, stopped = recorder.sequences, True
        logps = recorder.logprobs(seqs)
        new = seqs[:, ids.shape[1]:].cpu()
        for j, r in enumerate(rows):
            toks = new[j].tolist()
            ended = ended_at(toks, stops)
            end = len(toks) if ended is None else ended
            r.tokens += toks[:end]
            r.logprobs += logps[j, :end].tolist()
            r.versions += [version] * end
            r.truncated = ended is None and len(r.tokens) >= (self.limit if r.limit is None else r.limit)
            r.done = ended is not None or r.truncated
        return stopped


class _Finished:
    """A logits processor placed before the recorder: counts the rows that have drawn a stop token, and is the
    recorder's interruption (`pending`: asks `stop(finished, rows)` after each step)."""

    def __init__(self, start: int, stops: list[int], stop, device: torch.device | None = None):
        self.start, self.stop, self.finished = start, stop, 0
        self.stops = torch.tensor(stops, dtype=torch.long, device=device)

    def __call__(self, input_ids, scores):
        self.finished = int(torch.isin(input_ids[:, self.start:], self.stops).any(-1).sum()) \
            if input_ids.shape[1] > self.start else 0
        self.rows = input_ids.shape[0]
        return scores

    def pending(self) -> bool:
        return self.stop(self.finished, self.rows)


class HFDecoder:
    """The hf engine's side of the streaming sampler: the policy held resident in the flow's process (loaded in
    place), decoded by a ContinuousSampler. The vLLM engine's: tasks/engines/vllm_stream.py (VLLMDecoder)."""

    def __init__(self, cfg: Config, params: SamplingParams):
        self.cfg, self.params, self.sampler = cfg, params, None
        self.path, self.identity = None, None

    def load(self, key: str, path: str) -> None:
        identity = _identity(self.cfg, path)
        if identity is None:
            raise RuntimeError(f"generate.streaming: {key} is not a model folder or an adapter on one (a hub id?); "
                               "the streaming sampler loads policies in place")
        with RESIDENT.lock:
            RESIDENT.hold(self.cfg, path, identity)
        self.path, self.identity = path, identity

    def step_batch(self, rows: list, version: int, stop) -> bool:
        if self.sampler is None:
            gc = self.cfg.generate
            self.sampler = ContinuousSampler(load_tokenizer(self.path), self.params, gc.max_completion_length,
                                             gc.share_prompts)
        with RESIDENT.lock:        # (another session may have loaded its policy meanwhile: ours again)
            model = RESIDENT.hold(self.cfg, self.path, self.identity)
            return self.sampler.step_batch(model, rows, version, stop)

    def close(self) -> None:
        """Nothing of its own: the resident policy stays for the run's other sessions."""

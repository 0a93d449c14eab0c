"""Stage 1 — generate: sample `num_generations` completions for each of this iteration's prompts.

    python -m tasks.generate --config configs/tiny.yaml --iteration 3 --policy base|<store key of a policy>

Reads the policy (the base model for iteration 1, else the policy published by the previous iteration) and
the dataset; writes `<run>/iter-N/rollouts` (token ids, text, behaviour logprobs, truncation flag).
Idempotent: if that folder is complete and was made from the same inputs, it is returned as is.
Engine: hf (transformers). The sampled tokens' logprobs are taken after temperature/top-p, i.e. from the
distribution actually sampled from, which is what importance ratios need.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from tasks import data, layout, rollout
from tasks.models import encode_prompt, load_model, load_tokenizer, open_store, policy_path, device_for
from tasks.rollout import Rollout
from tasks.stage import fingerprint, reuse, result, stage_cli


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


def _hf_generate(model, tokenizer, prompt_ids: list[list[int]], cfg, seed: int):
    """-> per completion: (prompt index, completion ids incl. EOS, logprobs, truncated)."""
    from transformers import GenerationConfig, LogitsProcessorList

    g = cfg.generate
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=g.max_completion_length,
                               num_return_sequences=g.num_generations, pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=eos)
    torch.manual_seed(seed)
    out = []
    for start in range(0, len(prompt_ids), g.batch_size):
        chunk = prompt_ids[start:start + g.batch_size]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[tokenizer.pad_token_id] * (L - len(p)) + p for p in chunk], device=device)
        attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk], device=device)
        recorder = _SampleAndRecord(g.temperature, g.top_p)
        with torch.no_grad():
            seqs = model.generate(input_ids=ids, attention_mask=attn, generation_config=gen_cfg,
                                  logits_processor=LogitsProcessorList([recorder]))
        logps = recorder.finish(seqs)
        completions = seqs[:, L:].cpu()
        for n in range(completions.shape[0]):
            toks = completions[n].tolist()
            stop = toks.index(eos) + 1 if eos in toks else None
            toks = toks[:stop] if stop else toks
            out.append((start + n // g.num_generations, toks, logps[n, :len(toks)].tolist(), stop is None))
    return out


def generate(cfg, iteration: int, policy: str = layout.BASE) -> dict:
    """Sample completions for iteration `iteration` from `policy`; returns {key, uri, metrics}."""
    store = open_store(cfg)
    key = layout.rollouts(cfg.run.name, iteration)
    fp = fingerprint(cfg, ("model", "data", "generate"), iteration=iteration, policy=policy)
    if (done := reuse(store, key, fp)) is not None:
        return done

    t0 = time.perf_counter()
    ds = data.load_prompts(cfg)
    P = cfg.generate.prompts_per_iteration
    start = data.cursor(iteration, P)
    rows = data.indices(len(ds), cfg.run.seed, start, P, cfg.data.shuffle)
    path = policy_path(cfg, policy)
    tokenizer = load_tokenizer(path)
    model = load_model(path, cfg.model.dtype, device_for(cfg)).eval()
    prompts = [ds[r][cfg.data.prompt_column] for r in rows]
    prompt_ids = [encode_prompt(tokenizer, p, cfg.generate.max_prompt_length) for p in prompts]

    t_gen = time.perf_counter()
    samples = _hf_generate(model, tokenizer, prompt_ids, cfg, seed=cfg.run.seed * 1_000_003 + iteration)
    gen_seconds = time.perf_counter() - t_gen

    records = []
    for group, ids, logps, truncated in samples:
        row = ds[rows[group]]
        columns = {k: v for k, v in row.items() if k != cfg.data.prompt_column}
        records.append(Rollout(group=group, row=rows[group], prompt=prompts[group], prompt_ids=prompt_ids[group],
                               completion=tokenizer.decode(ids, skip_special_tokens=True), completion_ids=ids,
                               logprobs=logps, truncated=truncated, columns=columns))
    n_tokens = sum(len(r.completion_ids) for r in records)
    metrics = {
        "generate/completion_length": n_tokens / len(records),
        "generate/truncated_share": sum(r.truncated for r in records) / len(records),
        "generate/tokens_per_s": n_tokens / max(gen_seconds, 1e-9),
        "generate/seconds": time.perf_counter() - t0,
    }
    with tempfile.TemporaryDirectory(prefix="rlflow-generate-") as tmp:
        rollout.write(records, Path(tmp))
        manifest = store.put_folder(key, Path(tmp), meta={"fingerprint": fp, "metrics": metrics, "policy": policy,
                                                          "data_cursor": start + P})
    return result(store, key, manifest)


if __name__ == "__main__":
    stage_cli(generate, "generate", takes_policy=True)

"""Interruption, not abortion (issue 42, item 2; the hf engine's part): a newer policy arriving while sequences
decode is loaded between two decode steps and the sequences continue from their partial tokens under it. Every
token records the version that drew it, its behaviour logprob is exactly that version's (checked against each
model's own forward pass), nothing decoded is thrown away, and a run with the same interruption point is the
same run again."""

from __future__ import annotations

import copy

import torch

from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.models import base_path, load_model, load_tokenizer
from tasks.engines.hf import hf_generate
from tests.conftest import TINY


class AfterSteps:
    """An interruption that becomes pending after `steps` decode steps and loads `new` in place."""

    def __init__(self, steps: int, new: torch.nn.Module, version: int = 1):
        self.left, self.new, self.version, self.applied = steps, new, version, 0

    def pending(self) -> bool:
        self.left -= 1
        return self.left == 0

    def apply(self, model):
        with torch.no_grad():
            for name, tensor in self.new.state_dict().items():
                model.state_dict()[name].copy_(tensor)
        self.applied += 1
        return model, self.version


def _teacher_forced(model, prompt: list[int], completion: list[int], temperature: float) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1).tolist()


def test_a_new_policy_mid_sequence_is_loaded_between_steps_and_nothing_decoded_is_lost():
    cfg = load_config(TINY, [])
    tok = load_tokenizer(base_path(cfg))
    old = load_model(base_path(cfg)).eval()
    new = copy.deepcopy(old)
    with torch.no_grad():                       # another policy: every weight moved
        gen = torch.Generator().manual_seed(0)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("c=", "hello x=", "abcdefg=")]
    params = SamplingParams(n=3, max_new_tokens=8, temperature=0.8, top_p=1.0, seed=7)
    plain = hf_generate(copy.deepcopy(old), tok, prompts, params, batch_size=2)
    assert all(s.versions is None for s in plain)

    k = 3
    runs, shapes = [], []
    for _ in range(2):
        model, interrupt = copy.deepcopy(old), AfterSteps(k, new)
        hook = model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                               with_kwargs=True)     # (a hook: generate reads forward's signature)
        runs.append(hf_generate(model, tok, prompts, params, batch_size=2, interrupt=interrupt))
        hook.remove()
        assert interrupt.applied == 1
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), new.state_dict().values()))
    got, again = runs
    assert [(s.completion_ids, s.logprobs, s.versions) for s in got] == \
        [(s.completion_ids, s.logprobs, s.versions) for s in again]        # the same interruption, the same run

    # the refill fills each prompt once for its continuing rows (then their k tokens each), as the first prefill
    # does (each prompt but its last token), not each row's prompt again
    L = max(len(p) for p in prompts[:2])
    assert (2, L - 1) in shapes and (2, L) in shapes and not any(rows > 2 and n >= L for rows, n in shapes)
    first_chunk = [s for s in got if s.prompt < 2]          # (the interruption came in the first generate call)
    later = [s for s in got if s.prompt >= 2]
    eos = tok.eos_token_id
    for s, p in zip(got, plain):
        ended = bool(s.completion_ids) and s.completion_ids[-1] == eos
        assert ended or (len(s.completion_ids) == params.max_new_tokens and s.truncated)   # ran to its end
        assert len(s.versions) == len(s.completion_ids) == len(s.logprobs)
        if s.prompt < 2:                     # its first k tokens are the old policy's draws, as without it
            assert s.completion_ids[:k] == p.completion_ids[:k]
    for s in first_chunk:
        before = min(k, len(s.completion_ids))
        assert s.versions == [0] * before + [1] * (len(s.completion_ids) - before)
        prompt = prompts[s.prompt]
        mine = _teacher_forced(old, prompt, s.completion_ids[:before], params.temperature)
        assert max(abs(a - b) for a, b in zip(mine, s.logprobs[:before])) < 1e-4
        if len(s.completion_ids) > before:   # the rest: exactly the new policy's, on the whole prefix
            theirs = _teacher_forced(new, prompt, s.completion_ids, params.temperature)[before:]
            assert max(abs(a - b) for a, b in zip(theirs, s.logprobs[before:])) < 1e-4
            stale = _teacher_forced(old, prompt, s.completion_ids, params.temperature)[before:]
            assert max(abs(a - b) for a, b in zip(stale, s.logprobs[before:])) > 1e-2   # (the check can fail)
    assert any(len(s.completion_ids) > k and s.versions[-1] == 1 for s in first_chunk)   # some continued
    for s in later:                          # sampled after the swap: the new policy's alone
        assert set(s.versions) == {1}
        theirs = _teacher_forced(new, prompts[s.prompt], s.completion_ids, params.temperature)
        assert max(abs(a - b) for a, b in zip(theirs, s.logprobs)) < 1e-4

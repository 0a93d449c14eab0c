"""The one function both sides of RL must agree on: what the trainer thinks the policy's logprob of each
sampled token is, with the same temperature the generator sampled at. The generators record the same
quantity (after temperature and top-p) as the behaviour logprobs; tests/test_vllm.py holds the two equal.
"""

from __future__ import annotations

import torch


def completion_logprobs(model, ids, attn, positions, n_completion: int, temperature: float,
                        with_entropy: bool = False, with_hidden: bool = False):
    """Logprob of each completion token under `model`: (B, Lc) float32, and optionally entropy (B, Lc); with
    `with_hidden` also the last hidden state of the positions that predict them (B, Lc, H): a value head's input
    (the state before each token)."""
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=positions.to(device),
                logits_to_keep=n_completion + 1, **({"output_hidden_states": True} if with_hidden else {}))
    if with_hidden:
        hidden = out.hidden_states[-1][:, -(n_completion + 1):-1]
        return (*_logprobs(out, ids, n_completion, temperature, with_entropy, device), hidden)
    return _logprobs(out, ids, n_completion, temperature, with_entropy, device)


def _logprobs(out, ids, n_completion: int, temperature: float, with_entropy: bool, device):
    logits = out.logits[:, :-1].float() / temperature            # (B, Lc, V): logits at t predict token t+1
    targets = ids[:, -n_completion:].to(device)                   # (B, Lc)
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp, None
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy

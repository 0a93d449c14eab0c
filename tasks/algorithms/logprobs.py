"""The one function both sides of RL must agree on: what the trainer thinks the policy's logprob of each
sampled token is, with the same temperature the generator sampled at. The generators record the same
quantity (after temperature and top-p) as the behaviour logprobs; tests/test_vllm.py holds the two equal.
"""

from __future__ import annotations

import torch

_CAN_SHARE: dict[type, bool] = {}      # model classes whose KV cache turned out not to support a row gather


def completion_logprobs(model, ids, attn, positions, n_completion: int, temperature: float,
                        with_entropy: bool = False, with_hidden: bool = False, share_prompts: bool = True):
    """Logprob of each completion token under `model`: (B, Lc) float32, and optionally entropy (B, Lc); with
    `with_hidden` also the last hidden state of the positions that predict them (B, Lc, H): a value head's input
    (the state before each token).

    Rows that share their prompt (a GRPO group: num_generations completions of one prompt) have the prompt run
    once (`share_prompts`, see shared_prompt_forward): the same numbers as one forward over every row, up to float
    rounding, for a fraction of the work when prompts are longer than completions."""
    device = next(model.parameters()).device
    ids, attn, positions = ids.to(device), attn.to(device), positions.to(device)
    extra = {"output_hidden_states": True} if with_hidden else {}
    shared = prompt_groups(ids, n_completion) if share_prompts and _CAN_SHARE.get(type(model), True) else None
    out = shared_prompt_forward(model, ids, attn, positions, n_completion, *shared, **extra) if shared else None
    if shared is not None and out is None:              # a model whose KV cache cannot be gathered by rows
        _CAN_SHARE[type(model)] = False
    if out is None:
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=n_completion + 1,
                    **extra)
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


def prompt_groups(ids: torch.Tensor, n_completion: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(one row of each distinct prompt (U,), each row's prompt among them (B,)), or None when the prompts are a
    single token (nothing to put in a cache). ids: (B, Lp+Lc), prompts left-padded to Lp.

    Also when no two rows share a prompt the forward is split the same way (U = B): every micro-batch, on every
    process, then has the same graph, which DeepSpeed needs (ZeRO reduces gradients in buckets in the order the
    backward makes them ready; two processes with differently shaped graphs would sum mismatched buckets)."""
    prompt_len = ids.shape[1] - n_completion
    if prompt_len < 2:
        return None
    distinct, inverse = torch.unique(ids[:, :prompt_len], dim=0, return_inverse=True)
    first = torch.full((distinct.shape[0],), ids.shape[0], dtype=torch.long, device=ids.device)
    first = first.scatter_reduce(0, inverse, torch.arange(ids.shape[0], device=ids.device), reduce="amin")
    return first, inverse


def shared_prompt_forward(model, ids, attn, positions, n_completion: int, first: torch.Tensor, inverse: torch.Tensor,
                          **kwargs):
    """One forward of the rows' model, its distinct prompts run once: the prompts but their last token (U rows) fill
    a KV cache, each row gets its prompt's keys and values (a gather: gradients flow back to the one prompt
    forward), then the last prompt token and the completion run on top of it (B rows). The logits and hidden
    states are those of the last 1 + Lc positions, what a full forward with logits_to_keep = Lc + 1 gives.

    Why: GRPO samples num_generations completions of each prompt; a full forward runs every prompt that many
    times. With prompts of ~60 tokens and completions of ~16 (the SmolLM2 arithmetic recipe, 8 per prompt) the
    model sees 8x60 + 64x17 tokens instead of 64x76: ~3x less work, forward and backward. None when the model's KV
    cache cannot be gathered by rows (the caller then runs one full forward)."""
    cut = ids.shape[1] - n_completion - 1          # prompt tokens in the cache: all but the last
    prefix = model(input_ids=ids[first, :cut], attention_mask=attn[first, :cut], position_ids=positions[first, :cut],
                   use_cache=True, logits_to_keep=1)
    cache = prefix.past_key_values
    try:
        cache.batch_select_indices(inverse)
    except (AttributeError, NotImplementedError):      # (no cache, or one whose layers cannot be gathered)
        return None
    return model(input_ids=ids[:, cut:], attention_mask=attn, position_ids=positions[:, cut:], past_key_values=cache,
                 use_cache=True, logits_to_keep=n_completion + 1, **kwargs)

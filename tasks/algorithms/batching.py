"""Scored rollouts as padded micro-batches: built once per iteration, reused by every optimiser pass.

A micro-batch is a memory knob, never a change of objective: the loss is normalised by the whole batch's
token and sequence counts (tasks/algorithms/loss.py), so the accumulated gradient is the full batch's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from tasks.core.contracts import MicroBatch

if TYPE_CHECKING:
    from tasks.core.config import TrainConfig
    from tasks.core.contracts import Rollout


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """[left-padded prompt | right-padded completion] with attention mask, position ids and completion mask.

    Shapes: ids, attention (B, Lp+Lc); completion_mask (B, Lc). Position ids count real tokens only, so a
    left-padded row sees the same positions as it did unpadded in the generator.
    """
    Lp = max(len(p) for p in prompts)
    Lc = max(max(len(c) for c in completions), 1)
    # Rows are built as Python lists and converted once: per-row tensor writes cost more than the step itself
    # at small sizes.
    rows, attn_rows, cmask_rows = [], [], []
    for p, c in zip(prompts, completions):
        lp, lc = Lp - len(p), Lc - len(c)
        rows.append([pad_id] * lp + list(p) + list(c) + [pad_id] * lc)
        attn_rows.append([0] * lp + [1] * (len(p) + len(c)) + [0] * lc)
        cmask_rows.append([1.0] * len(c) + [0.0] * lc)
    ids = torch.tensor(rows, dtype=torch.long)
    attn = torch.tensor(attn_rows, dtype=torch.long)
    cmask = torch.tensor(cmask_rows, dtype=torch.float32)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids, attn, positions, cmask


def prepare_batches(records: list[Rollout], signal: torch.Tensor, pad_token_id: int, tc: TrainConfig,
                    device: torch.device | str) -> list[MicroBatch]:
    """Pad the scored rollouts into micro-batches of `tc.micro_batch_size` (signal: (N,), one per record: what
    the learner made of their rewards, tasks/algorithms/learners/)."""
    batches = []
    for start in range(0, len(records), tc.micro_batch_size):
        chunk = records[start:start + tc.micro_batch_size]
        ids, attn, pos, mask = pad_batch([r.prompt_ids for r in chunk], [r.completion_ids for r in chunk],
                                         pad_token_id)
        width = mask.shape[1]
        behaviour = torch.tensor([list(r.logprobs) + [0.0] * (width - len(r.logprobs)) for r in chunk],
                                 dtype=torch.float32)
        if any(r.mask is not None for r in chunk):     # multi-turn: the environment's tokens never enter the loss
            mask = mask * torch.tensor([list(r.mask or [1] * len(r.completion_ids))
                                        + [0] * (width - len(r.completion_ids)) for r in chunk], dtype=torch.float32)
        if tc.mask_truncated_completions:
            mask = mask * torch.tensor([[0.0 if r.truncated else 1.0] for r in chunk])
        batches.append(MicroBatch(ids=ids, attention=attn, positions=pos, mask=mask.to(device),
                                  behaviour=behaviour.to(device),
                                  signal=signal[start:start + len(chunk)].to(device), rows=len(chunk),
                                  share_prompts=tc.share_prompts,
                                  temperature=_per_token(chunk, "temperatures", width, device),
                                  top_p=_per_token(chunk, "top_ps", width, device)))
    return batches


def _per_token(chunk: list[Rollout], name: str, width: int, device) -> torch.Tensor | None:
    """(b, Lc) of the rows' per-token sampling setting `name` (Rollout.temperatures / top_ps), NaN where a row
    has none (the run's setting), or None when no row of the chunk has its own."""
    if all(getattr(r, name) is None for r in chunk):
        return None
    nan = float("nan")
    return torch.tensor([list(getattr(r, name) or [])[:width] + [nan] * (width - len(getattr(r, name) or []))
                         for r in chunk], dtype=torch.float32, device=device)


def shard_batches(records: list[Rollout], signal: torch.Tensor, pad_token_id: int, tc: TrainConfig,
                  device: torch.device | str, rank: int, world_size: int) -> list[MicroBatch]:
    """This process's micro-batches: a contiguous shard of ceil(N / world_size) completions, padded with
    weightless micro-batches (mask 0, no rows) to the count of the largest shard: every process must run
    the same number of forwards and backwards, since ZeRO gathers and reduces inside them."""
    size = -(-len(records) // world_size)
    lo, hi = min(rank * size, len(records)), min((rank + 1) * size, len(records))
    batches = prepare_batches(records[lo:hi], signal[lo:hi], pad_token_id, tc, device)
    while len(batches) < -(-size // tc.micro_batch_size):
        empty = prepare_batches(records[:1], torch.zeros(1), pad_token_id, tc, device)[0]
        batches.append(dataclasses.replace(empty, mask=torch.zeros_like(empty.mask), rows=0))
    return batches

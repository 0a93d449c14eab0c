"""Stage 3 — train: one GRPO update on this iteration's scored rollouts.

    python -m tasks.train --config configs/tiny.yaml --iteration 3

Reads `<run>/iter-N/rewards` and the previous checkpoint (`<run>/trainer/ckpt-(N-1)`, or the base model for
N = 1); writes `<run>/trainer/ckpt-N` = model + optimizer state + RNG state + data cursor, then moves
`trainer/LATEST`. The loss and the advantages are the pure functions in tasks/loss.py and tasks/advantage.py;
this file only batches, steps and saves.

Engines (`train.engine`, chosen in `engine_for`, the only place this file looks at it): `torch` (below: one
process, one device) and `deepspeed` (tasks/deepspeed_engine.py: ZeRO 1-3 over several processes; started
here with torchrun when no torchrun started us). Both expose the same few calls: the model to run forward,
`backward(loss)`, `step() -> grad norm`, sums over processes, `save`. With several processes the advantages
are computed over the whole batch (groups complete), then each process takes a contiguous shard of the
completions; the loss is normalised by the whole batch's token/sequence counts, so the summed gradient is
the single-process whole-batch gradient.

With num_iterations = 1 the update is on-policy: the ratio is exp(logp - logp.detach()) = 1 and only the
gradient flows (TRL does the same). With num_iterations > 1, "old" logprobs are computed once before the
first pass and the later passes are clipped against them.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from tasks import data, layout, rollout
from tasks.advantage import group_advantages
from tasks.errors import UserError
from tasks.loss import aggregate, behaviour_correction, clip_stats, per_token_loss
from tasks.models import (add_lora, base_path, completion_logprobs, device_for, load_model, load_policy,
                          load_tokenizer, local_folder, open_store, pad_batch, rng_state, set_rng_state)
from tasks.stage import fingerprint, reuse, result, stage_cli

OPTIMIZER, RNG, STATE, MODEL_DIR = layout.CKPT_OPTIMIZER, layout.CKPT_RNG, layout.CKPT_STATE, layout.CKPT_MODEL



class TorchEngine:
    """One process, one device: AdamW, `clip_grad_norm_`; a checkpoint is the model folder (save_pretrained),
    optimizer.pt and rng.pt."""

    rank, world_size = 0, 1

    def __init__(self, model, optimizer, cfg, ref_model=None, lora: bool = False, tokenizer=None, step: int = 0):
        self.model, self.optimizer, self.cfg, self.ref_model, self.lora = model, optimizer, cfg, ref_model, lora
        self.tokenizer, self.global_step, self.device = tokenizer, step, next(model.parameters()).device

    @staticmethod
    def launch(cfg, iteration: int) -> bool:
        """Trains in this process (False: nothing was launched). Several processes would each write the same
        checkpoint, so a torchrun of more than one refuses."""
        for var in ("WORLD_SIZE", "NNODES"):
            if int(os.environ.get(var) or 1) > 1:
                raise UserError(f"train.engine: torch trains in one process on one device, but {var}="
                                f"{os.environ[var]}; use train.engine=deepspeed for several GPUs or nodes")
        return False

    @classmethod
    def open(cls, cfg, store, prev: str | None) -> "TorchEngine":
        """The policy, its optimizer and RNG from checkpoint `prev` (None: the base model, freshly seeded)."""
        tc = cfg.train
        device = device_for(cfg)
        if prev:
            folder = local_folder(store, prev)
            model_path = str(folder / MODEL_DIR)
            if (engine := json.loads((folder / STATE).read_text()).get("engine", "torch")) != "torch":
                raise UserError(f"train.engine: {store.uri(prev)} was written by the {engine} engine; keep one "
                                f"engine for a whole run, or start a new run.name")
        else:
            folder, model_path = None, base_path(cfg)
        tokenizer = load_tokenizer(model_path)
        if folder is not None:
            model = load_policy(cfg, model_path, device, trainable=True)
        else:
            torch.manual_seed(cfg.run.seed)          # before add_lora: adapter init draws from it
            random.seed(cfg.run.seed)
            model = load_model(model_path, cfg.model.dtype, device)
            if tc.lora_r:
                model = add_lora(model, tc)
        model.train()
        lora = tc.lora_r > 0
        # The reference policy is the starting weights: with LoRA, the same model with its adapter disabled.
        ref_model = None
        if tc.beta > 0 and not lora:
            ref_model = load_model(base_path(cfg), cfg.model.dtype, device).eval().requires_grad_(False)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=tc.lr,
                                      betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
        step = 0
        if folder is not None:
            optimizer.load_state_dict(torch.load(folder / OPTIMIZER, map_location=device, weights_only=True))
            set_rng_state(torch.load(folder / RNG, weights_only=False))
            step = json.loads((folder / STATE).read_text())["step"]
        return cls(model, optimizer, cfg, ref_model=ref_model, lora=lora, tokenizer=tokenizer, step=step)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> float:
        """Clip the accumulated gradient to train.max_grad_norm, step; returns the norm before clipping."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.max_grad_norm)
        self.optimizer.step()
        return float(grad_norm)

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, values: list[float]) -> list[float]:
        return values

    def min(self, values: list[float]) -> list[float]:
        return values

    def barrier(self) -> None:
        pass

    def save(self, out: Path, iteration: int) -> dict:
        """Model folder + optimizer + RNG into `out`; returns what state.json adds (nothing)."""
        self.model.save_pretrained(out / MODEL_DIR)
        self.tokenizer.save_pretrained(out / MODEL_DIR)
        torch.save(self.optimizer.state_dict(), out / OPTIMIZER)
        torch.save(rng_state(), out / RNG)
        return {}

    def close(self) -> None:
        pass


def engine_for(cfg):
    """The factory: the engine class `train.engine` names (deepspeed is imported only when chosen)."""
    if cfg.train.engine == "deepspeed":
        from tasks.deepspeed_engine import DeepSpeedEngine
        return DeepSpeedEngine
    return TorchEngine


def _micro_batches(records, size: int):
    for start in range(0, len(records), size):
        yield start, records[start:start + size]


def prepare_batches(records, advantages: torch.Tensor, pad_token_id: int, cfg, device) -> list[dict]:
    """Pad the scored rollouts into micro-batches once; every optimiser pass reuses them."""
    tc = cfg.train
    batches = []   # per micro-batch: padded tensors, built once and reused by every pass
    for start, chunk in _micro_batches(records, tc.micro_batch_size):
        ids, attn, pos, mask = pad_batch([r.prompt_ids for r in chunk], [r.completion_ids for r in chunk],
                                         pad_token_id)
        width = mask.shape[1]
        behaviour = torch.tensor([list(r.logprobs) + [0.0] * (width - len(r.logprobs)) for r in chunk],
                                 dtype=torch.float32)
        if tc.mask_truncated_completions:
            mask = mask * torch.tensor([[0.0 if r.truncated else 1.0] for r in chunk])
        batches.append(dict(ids=ids, attn=attn, pos=pos, mask=mask.to(device), behaviour=behaviour.to(device),
                            adv=advantages[start:start + len(chunk)].to(device), rows=len(chunk)))
    return batches


def shard_batches(records, advantages: torch.Tensor, pad_token_id: int, cfg, device, rank: int,
                  world_size: int) -> list[dict]:
    """This process's micro-batches: a contiguous shard of ceil(N / world_size) completions, padded with
    weightless micro-batches (mask 0, no rows) to the count of the largest shard: every process must run
    the same number of forwards and backwards, since ZeRO gathers and reduces inside them."""
    size = -(-len(records) // world_size)
    lo, hi = min(rank * size, len(records)), min((rank + 1) * size, len(records))
    batches = prepare_batches(records[lo:hi], advantages[lo:hi], pad_token_id, cfg, device)
    while len(batches) < -(-size // cfg.train.micro_batch_size):
        empty = prepare_batches(records[:1], torch.zeros(1), pad_token_id, cfg, device)[0]
        empty.update(mask=torch.zeros_like(empty["mask"]), rows=0)
        batches.append(empty)
    return batches


def _is_ratio(old, b, tc):
    return behaviour_correction(old, b["behaviour"], b["mask"], tc.importance_sampling_mode,
                                tc.importance_sampling_cap)


def optimise(engine, batches: list[dict], cfg) -> dict:
    """tc.num_iterations optimiser steps over the whole batch (gradients accumulated over micro-batches and
    processes, normalised over the whole batch). Returns statistics summed over all processes."""
    tc = cfg.train
    model, ref_model = engine.model, engine.ref_model
    num_tokens, num_seqs = engine.sum([float(sum(b["mask"].sum() for b in batches)),
                                       sum(b["rows"] for b in batches)])
    num_seqs = int(num_seqs)
    max_len = cfg.generate.max_completion_length
    # π_old needs its own forward only when there are several passes; with one pass it is the pass's own
    # logprobs, detached (same weights, same inputs), so the IS weight is computed from those.
    needs_old = tc.num_iterations > 1

    def logprobs_of(m, b, entropy=False):
        return completion_logprobs(m, b["ids"], b["attn"], b["pos"], b["mask"].shape[1], cfg.generate.temperature,
                                   with_entropy=entropy)

    with torch.no_grad():
        for b in batches:
            if ref_model is not None:
                b["ref"] = logprobs_of(ref_model, b)[0]
            elif tc.beta > 0 and engine.lora:
                with model.disable_adapter():
                    b["ref"] = logprobs_of(model, b)[0]
            if needs_old:   # the trainer's logprobs before this iteration's first step: π_old
                b["old"] = logprobs_of(model, b)[0]
            if tc.importance_sampling_correction and needs_old:
                b["is_ratio"] = _is_ratio(b["old"], b, tc)

    sums = dict(loss=0.0, kl_ref=0.0, mismatch_kl=0.0, entropy=0.0, clip_low_sum=0.0, clip_high_sum=0.0,
                ratio_max=0.0, ratio_min=math.inf, ratio_sum=0.0, grad_norm=0.0, is_ratio_sum=0.0,
                is_ratio_min=math.inf)
    for pass_ in range(tc.num_iterations):
        engine.zero_grad()
        loss_total, clip = 0.0, {"clip_low_sum": 0.0, "clip_high_sum": 0.0}
        for b in batches:
            logp, entropy = logprobs_of(model, b, entropy=True)
            old = b["old"] if needs_old else logp.detach()   # on-policy: ratio 1, gradient only
            if tc.importance_sampling_correction and not needs_old:
                b["is_ratio"] = _is_ratio(old, b, tc)
            ptl, ratio, kl = per_token_loss(logp, old, b["adv"], b["mask"], tc, ref_logp=b.get("ref"),
                                            is_ratio=b.get("is_ratio"))
            loss = aggregate(ptl, b["mask"], tc.loss_type, num_tokens, num_seqs, max_len)
            engine.backward(loss)
            loss_total += float(loss.detach())
            m = b["mask"]
            for k, v in clip_stats(ratio.detach(), b["adv"], m, tc).items():
                clip[k] += v
            ratio = ratio.detach().expand_as(m)
            if pass_ == 0:
                sums["entropy"] += float((entropy.detach() * m).sum())
                # KL(generator ‖ trainer) on the generator's own samples, k3 with r = π/μ; on pass 0 both
                # hold the same weights, so this measures engine/numerics mismatch alone.
                d = logp.detach() - b["behaviour"]
                sums["mismatch_kl"] += float(((torch.exp(d) - d - 1) * m).sum())
                if kl is not None:
                    sums["kl_ref"] += float((kl.detach() * m).sum())
                if "is_ratio" in b:
                    rho = b["is_ratio"].expand_as(m)[m.bool()]
                    if rho.numel():
                        sums["is_ratio_sum"] += float(rho.sum())
                        sums["is_ratio_min"] = min(sums["is_ratio_min"], float(rho.min()))
            real = ratio.detach()[m.bool()]
            sums["ratio_sum"] += float(real.sum())
            if real.numel():
                sums["ratio_max"] = max(sums["ratio_max"], float(real.max()))
                sums["ratio_min"] = min(sums["ratio_min"], float(real.min()))
        sums["grad_norm"] = engine.step()
        sums["loss"] = loss_total
        sums["clip_low_sum"], sums["clip_high_sum"] = clip["clip_low_sum"], clip["clip_high_sum"]
    added = ("loss", "kl_ref", "mismatch_kl", "entropy", "clip_low_sum", "clip_high_sum", "ratio_sum", "is_ratio_sum")
    sums.update(zip(added, engine.sum([sums[k] for k in added])))
    sums["ratio_max"], = engine.max([sums["ratio_max"]])
    sums["ratio_min"], sums["is_ratio_min"] = engine.min([sums["ratio_min"], sums["is_ratio_min"]])
    sums["num_tokens"] = num_tokens
    return sums


def train(cfg, iteration: int) -> dict:
    """Update the policy on iteration `iteration`'s scored rollouts; returns {key, uri, metrics}."""
    store = open_store(cfg)
    run, tc = cfg.run.name, cfg.train
    key = layout.checkpoint(run, iteration)
    src = layout.rewards(run, iteration)
    src_manifest = store.manifest(src)
    if src_manifest is None:
        raise UserError(f"iteration {iteration}: no complete rewards at {store.uri(src)}; run reward first")
    prev = layout.checkpoint(run, iteration - 1) if iteration > 1 else None
    prev_manifest = store.manifest(prev) if prev else None
    if prev and prev_manifest is None:
        raise UserError(f"iteration {iteration}: previous checkpoint {store.uri(prev)} is missing; train in order")
    fp = fingerprint(cfg, ("model", "train"), iteration=iteration,
                     rewards=src_manifest["files"][rollout.FILE]["sha256"],
                     previous=prev_manifest["files"][STATE]["sha256"] if prev_manifest else layout.BASE)
    if (done := reuse(store, key, fp)) is not None:
        if int(os.environ.get("RANK") or 0) == 0:
            store.advance_pointer(layout.latest(run, "trainer"), key)  # a kill may have come between the two
        return done
    Engine = engine_for(cfg)
    if Engine.launch(cfg, iteration):   # deepspeed without torchrun around us: the workers trained; read it back
        if (done := reuse(store, key, fp)) is None:
            raise RuntimeError(f"train[iter {iteration}]: the {tc.engine} workers exited 0 without writing "
                               f"{store.uri(key)}")
        return done

    t0 = time.perf_counter()
    engine = Engine.open(cfg, store, prev)
    try:
        with tempfile.TemporaryDirectory(prefix="rlflow-train-") as tmp:
            store.get_folder(src, Path(tmp))
            records = rollout.read(Path(tmp))
        rewards = torch.tensor([math.nan if r.reward is None else r.reward for r in records])
        advantages = group_advantages(rewards, cfg.generate.num_generations, tc.scale_rewards)   # (N,)

        batches = shard_batches(records, advantages, engine.tokenizer.pad_token_id, cfg, engine.device,
                                engine.rank, engine.world_size)
        sums = optimise(engine, batches, cfg)
        engine.global_step += tc.num_iterations
        metrics = _metrics(sums, rewards, advantages, tc, time.perf_counter() - t0)

        with tempfile.TemporaryDirectory(prefix="rlflow-ckpt-") as tmp:
            out = Path(tmp)
            extra = engine.save(out, iteration)          # every process: deepspeed gathers and saves shards
            if engine.rank == 0:                         # one writer
                (out / STATE).write_text(json.dumps({
                    "iteration": iteration, "step": engine.global_step,
                    "data_cursor": data.cursor(iteration + 1, cfg.generate.prompts_per_iteration), **extra}))
                manifest = store.put_folder(key, out, meta={"fingerprint": fp, "metrics": metrics,
                                                             "iteration": iteration})
                store.advance_pointer(layout.latest(run, "trainer"), key)
        engine.barrier()                                 # the others return once the checkpoint is complete
    finally:
        engine.close()
    return result(store, key, manifest) if engine.rank == 0 else reuse(store, key, fp)


def clean_engine_state(store, run: str) -> int:
    """Remove the deepspeed node folders that no committed checkpoint names: those of attempts killed (or beaten
    by another attempt) before their ckpt-N was committed. Folders of iteration N go only once ckpt-N is
    complete: a committed checkpoint is immutable, so an attempt it does not name can never be needed, while
    before that a running attempt may still be writing its own. An iteration with one attempt has nothing to
    remove (its checkpoint, if committed, names it), so only iterations with several cost a read: the flow runs
    this at every start without reading every checkpoint of a long run. Returns how many attempt folders went."""
    base, removed, attempts = f"{run}/trainer-state", 0, {}
    for name in store.list_folders(base):                       # ckpt-000042-<attempt>
        head, _, attempt = name.partition("-")[2].partition("-")
        if head.isdigit() and attempt:
            attempts.setdefault(int(head), []).append(f"{base}/{name}")
    for iteration, folders in attempts.items():
        ckpt = layout.checkpoint(run, iteration)
        if len(folders) < 2 or store.manifest(ckpt) is None:
            continue
        named = {p.rsplit("/", 1)[0] for p in store.get_json(ckpt, STATE).get("engine_state", [])}
        for folder in folders:
            if folder not in named:
                for node in store.list_folders(folder):
                    store.delete_folder(f"{folder}/{node}")
                removed += 1
    return removed


def _metrics(sums: dict, rewards, advantages, tc, seconds: float) -> dict:
    num_tokens = sums["num_tokens"]
    present = rewards[~torch.isnan(rewards)]
    denom = max(num_tokens, 1.0)   # every completion may be masked (mask_truncated_completions)
    metrics = {
        "train/loss": sums["loss"],
        "train/grad_norm": sums["grad_norm"],
        "train/entropy": sums["entropy"] / denom,
        "train/mismatch_kl": sums["mismatch_kl"] / denom,
        "train/clip_low": sums["clip_low_sum"] / denom,
        "train/clip_high": sums["clip_high_sum"] / denom,
        "train/clip_region": (sums["clip_low_sum"] + sums["clip_high_sum"]) / denom,   # TRL's region_mean
        "train/ratio_mean": sums["ratio_sum"] / (denom * tc.num_iterations) if num_tokens else 1.0,
        "train/ratio_min": sums["ratio_min"] if math.isfinite(sums["ratio_min"]) else 1.0,
        "train/ratio_max": sums["ratio_max"],
        "train/advantage_std": float(advantages.std()) if advantages.numel() > 1 else 0.0,
        "train/reward_mean": float(present.mean()) if present.numel() else 0.0,
        "train/tokens_per_s": num_tokens * tc.num_iterations / max(seconds, 1e-9),
        "train/seconds": seconds,
    }
    if tc.beta > 0:
        metrics["train/kl_ref"] = sums["kl_ref"] / denom
    if tc.importance_sampling_correction:
        metrics["train/is_ratio_mean"] = sums["is_ratio_sum"] / denom
        metrics["train/is_ratio_min"] = sums["is_ratio_min"] if math.isfinite(sums["is_ratio_min"]) else 1.0
    return metrics


if __name__ == "__main__":
    stage_cli(train, "train")

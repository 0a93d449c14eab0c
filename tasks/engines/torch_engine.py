"""The torch training engine (`train.engine: torch`, the default): one process, one device.

AdamW and `clip_grad_norm_`; a checkpoint is the model folder (save_pretrained: what publish ships),
optimizer.pt and rng.pt. With `train.lora_r` the model is a peft model and only the adapter is trained,
checkpointed and published; the KL reference is then the same model with its adapter disabled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.core import layout
from tasks.core.errors import UserError
from tasks.core.models import add_lora, base_path, device_for, load_model, load_policy, load_tokenizer, local_folder
from tasks.engines.training import rng_state, seed_all, set_rng_state

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store


class TorchEngine:
    """One process, one device (tasks/engines/training.py: TrainingEngine)."""

    rank, world_size = 0, 1

    def __init__(self, model, optimizer: torch.optim.Optimizer, cfg: Config, ref_model=None, lora: bool = False,
                 tokenizer=None, step: int = 0):
        self.model, self.optimizer, self.cfg, self.ref_model, self.lora = model, optimizer, cfg, ref_model, lora
        self.tokenizer, self.global_step, self.device = tokenizer, step, next(model.parameters()).device

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """torch is rlflow's own dependency: nothing to check."""

    @classmethod
    def launch(cls, cfg: Config, iteration: int) -> bool:
        """Trains in this process (False: nothing was launched). Several processes would each write the same
        checkpoint, so a torchrun of more than one refuses."""
        for var in ("WORLD_SIZE", "NNODES"):
            if int(os.environ.get(var) or 1) > 1:
                raise UserError(f"train.engine: torch trains in one process on one device, but {var}="
                                f"{os.environ[var]}; use train.engine=deepspeed for several GPUs or nodes")
        return False

    @classmethod
    def open(cls, cfg: Config, store: Store, previous: str | None) -> TorchEngine:
        """The policy, its optimizer and RNG from checkpoint `previous` (None: the base model, freshly seeded)."""
        tc = cfg.train
        device = device_for(cfg)
        if previous:
            folder = local_folder(store, previous)
            model_path = str(folder / layout.CKPT_MODEL)
            state = json.loads((folder / layout.CKPT_STATE).read_text())
            if (engine := state.get("engine", "torch")) != "torch":
                raise UserError(f"train.engine: {store.uri(previous)} was written by the {engine} engine; keep one "
                                f"engine for a whole run, or start a new run.name")
        else:
            folder, model_path = None, base_path(cfg)
        tokenizer = load_tokenizer(model_path)
        if folder is not None:
            model = load_policy(cfg, model_path, device, trainable=True)
        else:
            seed_all(cfg.run.seed)                   # before add_lora: adapter init draws from it
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
            optimizer.load_state_dict(torch.load(folder / layout.CKPT_OPTIMIZER, map_location=device,
                                                 weights_only=True))
            set_rng_state(torch.load(folder / layout.CKPT_RNG, weights_only=False))
            step = state["step"]
        return cls(model, optimizer, cfg, ref_model=ref_model, lora=lora, tokenizer=tokenizer, step=step)

    @staticmethod
    def clean(store: Store, run: str) -> int:
        """A checkpoint of this engine is one folder, committed by its manifest: nothing is left outside it."""
        return 0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
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
        self.model.save_pretrained(out / layout.CKPT_MODEL)
        self.tokenizer.save_pretrained(out / layout.CKPT_MODEL)
        torch.save(self.optimizer.state_dict(), out / layout.CKPT_OPTIMIZER)
        torch.save(rng_state(), out / layout.CKPT_RNG)
        return {}

    def close(self) -> None:
        pass

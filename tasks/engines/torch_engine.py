"""The torch training engine (`train.engine: torch`, the default): one process, one device.

AdamW and `clip_grad_norm_`. A full checkpoint is the model folder (save_pretrained in publish.dtype: what
publish ships), the exact weights in weights.safetensors when publish.dtype is not the training dtype,
optimizer.pt and rng.pt; a lean one is the model folder alone. With `train.lora_r` the model is a peft model
and only the adapter is trained, checkpointed and published; the KL reference is then the same model with its
adapter disabled.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tasks.algorithms.learners.registry import learner_class
from tasks.core import layout
from tasks.core.artifacts import stored
from tasks.core.errors import UserError
from tasks.core.models import (
    DTYPES,
    add_lora,
    base_path,
    checkpointing,
    device_for,
    load_model,
    load_policy,
    load_tokenizer,
    policy_dtype,
)
from tasks.core.process_wide import rng_state, seed_all, set_rng_state

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store


class TorchEngine:
    """One process, one device (tasks/engines/training.py: TrainingEngine)."""

    rank, world_size = 0, 1
    partial_backward = True         # a micro-batch may run its backward on some rows only (tasks/algorithms/update.py)

    def __init__(self, model, optimizer: torch.optim.Optimizer, cfg: Config, ref_model=None, lora: bool = False,
                 tokenizer=None, step: int = 0, critic=None):
        self.model, self.optimizer, self.cfg, self.ref_model, self.lora = model, optimizer, cfg, ref_model, lora
        self.critic = critic                          # train.algorithm: ppo: the value model (engines/critic.py)
        self.tokenizer, self.global_step, self.device = tokenizer, step, next(model.parameters()).device
        self._layout: _PolicyLayout | None = None     # what save_pretrained wrote the first time (see there)

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """torch is rlflow's own dependency: nothing to check."""

    @classmethod
    def open(cls, cfg: Config, store: Store, previous: str | None) -> TorchEngine:
        """The policy, its optimizer and RNG from checkpoint `previous` (None: the base model, freshly seeded)."""
        tc = cfg.train
        device = device_for(cfg)
        if previous:
            folder = store.local(previous)
            model_path, at = str(folder / layout.CKPT_MODEL), store.uri(previous)
            with stored(previous, f"{at}/{layout.CKPT_STATE}"):
                state = json.loads((folder / layout.CKPT_STATE).read_text())
                step = int(state["step"])
            if (engine := state.get("engine", "torch")) != "torch":
                raise UserError(f"train.engine: {store.uri(previous)} was written by the {engine} engine; keep one "
                                f"engine for a whole run, or start a new run.name")
        else:
            folder, model_path = None, base_path(cfg)
        tokenizer = load_tokenizer(model_path)
        if folder is not None:
            for weights in sorted(folder.rglob("*.safetensors")):      # (its own files decode: else it is corrupt,
                name = weights.relative_to(folder).as_posix()            # not the loading's fault)
                with stored(previous, f"{at}/{name}"), safe_open(str(weights), framework="pt") as opened:
                    opened.keys()
            model = load_policy(cfg, model_path, device, trainable=True)
            if (folder / layout.CKPT_WEIGHTS).exists():       # model/ holds the policy in publish.dtype
                _load_exact(model, load_file(folder / layout.CKPT_WEIGHTS, device=str(device)))
        else:
            seed_all(cfg.run.seed)                   # before add_lora: adapter init draws from it
            model = load_model(model_path, cfg.model.dtype, device)
            if tc.lora_r:
                model = add_lora(model, tc)
        checkpointing(model, tc).train()
        lora = tc.lora_r > 0
        # The reference policy is the starting weights: with LoRA, the same model with its adapter disabled.
        ref_model = None
        if tc.beta > 0 and not lora:
            ref_model = load_model(base_path(cfg), cfg.model.dtype, device).eval().requires_grad_(False)
        params = [p for p in model.parameters() if p.requires_grad]
        critic = None
        if "critic" in learner_class(cfg).trains:   # ppo, vtrace_awr: a value model beside the policy
            from tasks.engines.critic import Critic

            critic = Critic.make(cfg, model, device)
            if folder is not None:
                critic.load(folder)
            params = [{"params": params}, {"params": list(critic.parameters()), "lr": tc.learner.critic_lr or tc.lr}]
        optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=tuple(tc.adam_betas), weight_decay=tc.weight_decay)
        step = 0 if folder is None else step
        if folder is not None:
            with stored(previous, f"{at}/{layout.CKPT_OPTIMIZER}"):     # (decoding only: a mismatch is not the file's)
                saved = torch.load(folder / layout.CKPT_OPTIMIZER, map_location="cpu", weights_only=True)
            optimizer.load_state_dict(saved)
            with stored(previous, f"{at}/{layout.CKPT_RNG}"):     # (tensors and tuples: never code, weights_only)
                set_rng_state(torch.load(folder / layout.CKPT_RNG, weights_only=True))
        return cls(model, optimizer, cfg, ref_model=ref_model, lora=lora, tokenizer=tokenizer, step=step,
                   critic=critic)

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
        params = self.model.parameters() if self.critic is None else [*self.model.parameters(),
                                                                        *self.critic.parameters()]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.train.max_grad_norm)
        self.optimizer.step()
        return float(grad_norm)

    def critic_step(self, loss: torch.Tensor) -> None:
        """A step of the value model alone: the policy's gradients are None (zero_grad before), so AdamW passes
        over it."""
        loss.backward()
        self.step()

    def sum(self, values: list[float]) -> list[float]:
        return values

    def max(self, values: list[float]) -> list[float]:
        return values

    def min(self, values: list[float]) -> list[float]:
        return values

    def barrier(self) -> None:
        pass

    def save(self, out: Path, iteration: int) -> dict:
        """A full checkpoint into `out`; returns what state.json adds (nothing)."""
        return self._write_full(out, self._weights(), self.optimizer.state_dict(), rng_state(),
                                self.critic.state_dict() if self.critic is not None else None)

    def snapshot(self, iteration: int) -> Callable[[Path], dict]:
        """Copies (on the CPU) of the weights, the optimizer state and the RNG, taken now; training may go on
        while the returned function writes them as `save` would."""
        weights, optim = _copy(self._weights()), _copy(self.optimizer.state_dict())
        critic = _copy(self.critic.state_dict()) if self.critic is not None else None
        rng = rng_state()
        return lambda out: self._write_full(out, weights, optim, rng, critic)

    def save_policy(self, out: Path) -> None:
        """The policy alone (a lean checkpoint's model/)."""
        self._write_policy(out, self._weights())

    def _weights(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the model: every tensor, or with LoRA the adapter's."""
        state = self.model.state_dict()
        return {k: v for k, v in state.items() if "lora_" in k} if self.lora else state

    def _write_policy(self, out: Path, weights: dict[str, torch.Tensor]) -> None:
        dtype = policy_dtype(self.cfg)
        if dtype != self.cfg.model.dtype:    # the same tensors in publish.dtype, and a config that says so
            weights = _copy(weights, DTYPES[dtype])
        if self._layout is not None and self._layout.write(out, weights):
            return
        self.model.save_pretrained(out, state_dict=weights)
        if dtype != self.cfg.model.dtype:
            config = json.loads((out / "config.json").read_text())
            config["dtype"] = dtype
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        self.tokenizer.save_pretrained(out)
        self._layout = _PolicyLayout.of(out, weights)

    def _write_full(self, out: Path, weights: dict, optim: dict, rng: dict, critic: dict | None = None) -> dict:
        self._write_policy(out / layout.CKPT_MODEL, weights)
        if critic is not None:
            self.critic.save(out, critic)
        if policy_dtype(self.cfg) != self.cfg.model.dtype:       # the trainer's own weights, exactly
            save_file(_unique(weights), out / layout.CKPT_WEIGHTS)
        torch.save(optim, out / layout.CKPT_OPTIMIZER)
        torch.save(rng, out / layout.CKPT_RNG)
        return {}

    def loading_whole(self) -> contextlib.AbstractContextManager:
        """Models loaded in the body are whole (they always are here: DeepSpeedEngine's ZeRO-3 partitions)."""
        return contextlib.nullcontext()

    def close(self) -> None:
        pass


class _PolicyLayout:
    """What save_pretrained (+ the tokenizer's) wrote for this model once: its small files' bytes, and the
    names and metadata of its single weights file. A resident trainer writes a policy every iteration; the same
    files from these (safetensors' save_file with the same names, dtypes and metadata: the same bytes) take
    ~1 ms instead of save_pretrained's ~6 ms of model introspection, which dominates at the demo's size. Made
    only where the file is one shard whose every tensor is a weight of ours under its own name and shape (not
    for LoRA adapters, renamed keys or sharded folders: those keep save_pretrained)."""

    def __init__(self, files: dict[str, bytes], names: list[str], metadata: dict[str, str] | None):
        self.files, self.names, self.metadata = files, names, metadata

    @classmethod
    def of(cls, folder: Path, weights: dict[str, torch.Tensor]) -> _PolicyLayout | None:
        from safetensors import safe_open

        tensors = [p for p in folder.iterdir() if p.suffix == ".safetensors"]
        if [p.name for p in tensors] != ["model.safetensors"] or any(p.is_dir() for p in folder.iterdir()):
            return None
        with safe_open(tensors[0], "pt") as f:
            names, metadata = list(f.keys()), f.metadata()
            for name in names:
                t = weights.get(name)
                got = f.get_slice(name)
                if t is None or list(got.get_shape()) != list(t.shape) or str(t.dtype) != _TORCH_DTYPE.get(
                        got.get_dtype()):
                    return None
        return cls({p.name: p.read_bytes() for p in folder.iterdir() if p.suffix != ".safetensors"}, names,
                   metadata)

    def write(self, out: Path, weights: dict[str, torch.Tensor]) -> bool:
        if any(name not in weights for name in self.names):
            return False
        out.mkdir(parents=True, exist_ok=True)
        for name, data in self.files.items():
            (out / name).write_bytes(data)
        save_file({name: weights[name].contiguous() for name in self.names}, out / "model.safetensors",
                  metadata=self.metadata)
        return True


_TORCH_DTYPE = {"F32": "torch.float32", "BF16": "torch.bfloat16", "F16": "torch.float16", "F64": "torch.float64",
                "I64": "torch.int64", "I32": "torch.int32", "BOOL": "torch.bool", "U8": "torch.uint8"}


def _copy(tree, dtype: torch.dtype | None = None):
    """A copy of a state dict (nested dicts and lists of tensors) on the CPU, floating tensors in `dtype` if
    given; tensors that share storage (tied embeddings) stay shared, so save_pretrained sees the same ties."""
    memo: dict[tuple, torch.Tensor] = {}

    def one(x):
        if isinstance(x, torch.Tensor):
            key = (x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), tuple(x.stride()))
            if key not in memo:
                to = dtype if dtype is not None and x.is_floating_point() else x.dtype
                memo[key] = x.detach().to("cpu", to, copy=True)
            return memo[key]
        if isinstance(x, dict):
            return {k: one(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(one(v) for v in x)
        return copy.deepcopy(x)

    return one(tree)


def _unique(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One name per storage (safetensors refuses tensors that share memory); the first name is kept."""
    seen, out = set(), {}
    for name, tensor in weights.items():
        if (ptr := tensor.untyped_storage().data_ptr()) not in seen:
            seen.add(ptr)
            out[name] = tensor.contiguous()
    return out


def _load_exact(model, weights: dict[str, torch.Tensor]) -> None:
    """Load the exact weights over the policy's; a name left out by _unique must share its tensor's storage."""
    missing, unexpected = model.load_state_dict(weights, strict=False)
    state = model.state_dict()
    loaded = {state[name].untyped_storage().data_ptr() for name in weights}
    untied = [name for name in missing if state[name].untyped_storage().data_ptr() not in loaded
              and not (getattr(model, "peft_config", None) and "lora_" not in name)]
    if unexpected or untied:
        raise RuntimeError(f"checkpoint weights do not fit the model: unexpected {unexpected[:3]}, "
                           f"missing {untied[:3]}")

"""The training-engine contract, its factory, and what every engine shares.

    Engine = training_engine(cfg)                    # the class `train.engine` names: torch | deepspeed
    if Engine.launch(cfg, iteration): ...            # deepspeed: started its workers here; they trained
    engine = Engine.open(cfg, store, previous)       # model, optimizer, RNG (from checkpoint `previous`)
    ... engine.backward(loss) per micro-batch, engine.step() per pass (tasks/train.py: optimise) ...
    engine.save(folder, iteration); engine.close()

The GRPO math, batching and metrics stay in tasks/train.py and tasks/algorithms/; an engine owns the model,
the optimizer, the processes and the checkpoint format.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store


class TrainingEngine(Protocol):
    """One training process holding the policy, its optimizer and RNG (one of `world_size` processes)."""

    rank: int                       # this process, 0 .. world_size - 1; process 0 writes the checkpoint
    world_size: int
    device: torch.device
    model: torch.nn.Module          # what runs forward (a DeepSpeed engine wraps the module)
    ref_model: torch.nn.Module | None   # the starting weights for the KL term (None: beta 0, or LoRA)
    tokenizer: object
    lora: bool                      # the model is a peft model (the reference = its adapter disabled)
    global_step: int                # optimizer steps so far, over the whole run

    @classmethod
    def check_installed(cls, cfg: Config) -> None:
        """One UserError line if this machine cannot run the engine (a package missing)."""

    @classmethod
    def launch(cls, cfg: Config, iteration: int) -> bool:
        """Start the engine's processes if it needs several and none started us; True: they ran the whole
        stage (the checkpoint is in the store), False: train in this process."""

    @classmethod
    def open(cls, cfg: Config, store: Store, previous: str | None) -> TrainingEngine:
        """The policy, optimizer and RNG from checkpoint `previous` (a store key; None: the base model,
        freshly seeded)."""

    @staticmethod
    def clean(store: Store, run: str) -> int:
        """Remove what killed attempts of this engine left in the run's store folder; the lease holder calls
        it. Returns how many folders went."""

    def zero_grad(self) -> None: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def step(self) -> float:
        """Clip the accumulated gradient to train.max_grad_norm and step; the norm before clipping."""
    def sum(self, values: list[float]) -> list[float]: ...
    def max(self, values: list[float]) -> list[float]: ...
    def min(self, values: list[float]) -> list[float]: ...
    def barrier(self) -> None: ...
    def save(self, out: Path, iteration: int) -> dict:
        """Write the checkpoint's files into `out` (model/ as publish ships it); returns what state.json adds."""
    def close(self) -> None: ...


def training_engine(cfg: Config) -> type[TrainingEngine]:
    """The engine class `train.engine` names (deepspeed is imported only when chosen)."""
    if cfg.train.engine == "deepspeed":
        from tasks.engines.deepspeed_engine import DeepSpeedEngine
        return DeepSpeedEngine
    from tasks.engines.torch_engine import TorchEngine
    return TorchEngine


def rng_state() -> dict:
    """Every random stream training draws from (saved with a checkpoint, so a resume continues them)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    """Seed the streams rng_state saves (a fresh run, or a process a checkpoint did not have)."""
    torch.manual_seed(seed)
    random.seed(seed)

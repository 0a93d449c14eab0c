"""The training engines' factory, and what every engine shares (the contract, TrainingEngine:
tasks/core/contracts.py).

    Engine = training_engine(cfg)                    # the class `train.engine` names: torch | deepspeed
    engine = Engine.open(cfg, store, previous)       # model, optimizer, RNG (from checkpoint `previous`)
    ... engine.backward(loss) per micro-batch, engine.step() per pass (tasks/train.py: optimise) ...
    engine.save(folder, iteration); engine.close()

The GRPO math, batching and metrics are tasks/algorithms/'s, the same for every engine; an engine owns the
model, the optimizer, the processes and the checkpoint format. One iteration's work on any engine (update,
checkpoint, restore and replay) is the trainer's (tasks/engines/trainer.py: Trainer); here, what it and the
preflight read: the learner's signal over episodes, the off-line rollouts, the newest full checkpoint.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from tasks.core import data, layout, rollout

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Learner, Rollout, TrainingEngine
    from tasks.core.store import Store


def training_engine(cfg: Config) -> type[TrainingEngine]:
    """The engine class `train.engine` names (deepspeed is imported only when chosen)."""
    if cfg.train.engine == "deepspeed":
        from tasks.engines.deepspeed_engine import DeepSpeedEngine
        return DeepSpeedEngine
    from tasks.engines.torch_engine import TorchEngine
    return TorchEngine


def episode_signal(learner: Learner, records: list[Rollout]) -> torch.Tensor:
    """learner.signal over the episodes: an agent's episode split step-wise (Rollout.part > 0 after its first
    sample) counts once in the groups' statistics, and each of its samples gets the episode's signal. Computed in
    float64 (a group's rewards of 1e20 square past float32's range: its advantages were NaN), returned in float32."""
    rewards = torch.tensor([math.nan if r.reward is None else r.reward for r in records], dtype=torch.float64)
    lead = [i for i, r in enumerate(records) if not r.part]
    if len(lead) == len(records):
        return learner.signal(rewards).float()
    own = learner.signal(rewards[lead]).float()
    episode = (torch.tensor([not r.part for r in records]).cumsum(0) - 1).clamp(min=0)   # each row's episode
    return own[episode]


def offline_rollouts(cfg: Config, store: Store) -> list[str]:
    """The learner's off-line rollouts (train.learner.offline_rollouts), each checked to be a committed folder of
    scored rollouts: a reward stage's output (its manifest says how scoring went), not a generate output whose
    rows have no reward yet, and every row with a reward (the learner would otherwise train on rows with none).
    One line if not; the flow's preflight and the train stage (run by hand too) both check."""
    from tasks.core.errors import UserError

    field = "train.learner.offline_rollouts"
    keys = [key.strip("/") for key in cfg.train.learner.offline()]
    for key in keys:
        manifest = store.manifest(key)
        if manifest is None or rollout.FILE not in manifest["files"]:
            raise UserError(f"{field}: {key}: no scored rollouts at {store.uri(key)} (expected a rewards folder of "
                            f"this store, e.g. <run>/iter-000001/rewards)")
        if "errors" not in (manifest.get("meta") or {}):
            raise UserError(f"{field}: {key}: unscored rollouts (a generate output) at {store.uri(key)}; expected "
                            f"a rewards folder of this store, e.g. <run>/iter-000001/rewards")
        records = rollout.load(store, key)
        unscored = [i for i, r in enumerate(records) if r.reward is None]
        if not records or unscored:
            what = "no rows" if not records else (f"{data.row(unscored[0])}" + (f" and {len(unscored) - 1} more" if
                                                  len(unscored) > 1 else "") + f" of {len(records)} with reward null")
            raise UserError(f"{field}: {key}: {what} at {store.uri(key)}; off-line rows must all be scored")
    return keys


def newest_full(store: Store, run: str, at_most: int) -> tuple[str | None, int]:
    """The newest complete full checkpoint of iterations <= `at_most` (a process-mode `trainer/ckpt-N`, or a
    resident trainer's `trainer/full-N`) and its iteration; (None, 0) when there is none: the base model."""
    for key in (layout.checkpoint(run, at_most), layout.full_checkpoint(run, at_most)):   # the common cases
        manifest = store.manifest(key) if at_most > 0 else None
        if manifest is not None and manifest["meta"].get("kind", "full") == "full":
            return key, at_most
    found = []
    for name in store.list_folders(f"{run}/trainer"):
        kind, _, number = name.partition("-")
        if kind in ("ckpt", "full") and number.isdigit() and int(number) <= at_most:
            found.append((int(number), kind == "full", f"{run}/trainer/{name}"))
    for iteration, _, key in sorted(found, reverse=True):
        manifest = store.manifest(key)
        if manifest is not None and manifest["meta"].get("kind", "full") == "full":
            return key, iteration
    return None, 0

"""A learner is one class: it declares its fields on each micro-batch, its statistics and what it trains beside the
policy, and the update loop (tasks/algorithms/update.py: optimise) carries them without knowing it. The learner
here exists in this file alone: nothing in tasks/ names it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest
import torch
from pydantic import Field

from tasks.algorithms.learners.grpo import Grpo
from tasks.algorithms.stats import LearnerStats
from tasks.core.config import GrpoConfig, load_config
from tests.conftest import TINY


@dataclass
class Centred:
    """Its own field on each micro-batch: the rows' advantages minus the micro-batch's mean."""

    centred: torch.Tensor | None = None


@dataclass
class CentredStats(LearnerStats):
    per_pass = ("passes_loss",)
    kept = ("last_rows",)
    rows_seen: float = 0.0          # summed over processes
    passes_loss: float = 0.0        # restarts each pass: the last pass's
    last_rows: float = 0.0          # kept: the last micro-batch's rows


class CentredGrpo(Grpo):
    """GRPO's surrogate on advantages centred within each micro-batch (a learner of this test's own)."""

    rows, stats, trains = Centred, CentredStats, ()

    def prepare(self, engine, batches) -> None:
        for b in batches:
            b.own = Centred(b.signal - b.signal.mean())
            b.advantages = b.own.centred

    def loss(self, engine, b, fwd, totals, stats, first_pass: bool) -> torch.Tensor:
        loss = super().loss(engine, b, fwd, totals, stats, first_pass)
        own = stats.own
        own.passes_loss += float(loss.detach())
        own.last_rows = float(b.rows)
        if first_pass:
            own.rows_seen += float(b.rows)
        return loss

    def metrics(self, stats, metrics: dict[str, float], denom: float) -> None:
        metrics.update({"train/centred_rows": stats.own.rows_seen, "train/centred_last_loss": stats.own.passes_loss})


def test_a_learner_defined_outside_the_package_trains_through_the_one_update_loop():
    from tasks.algorithms.batching import prepare_batches
    from tasks.algorithms.update import optimise
    from tasks.core.contracts import Rollout
    from tasks.engines.torch_engine import TorchEngine

    cfg = load_config(TINY, ["train.num_iterations=2", "train.micro_batch_size=4"])
    engine = TorchEngine.open(cfg, None, None)
    records = [Rollout(group=i // 4, row=i // 4, prompt="p", prompt_ids=[3, 4, 5], completion="c",
                       completion_ids=[10 + i, 11, 12], logprobs=[-1.0, -1.5, -0.5], truncated=False,
                       reward=float(i % 3 == 0)) for i in range(8)]
    rewards = torch.tensor([r.reward for r in records])
    learner = CentredGrpo(cfg, 1)
    batches = prepare_batches(records, learner.signal(rewards), engine.tokenizer.pad_token_id, cfg.train, "cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stats = optimise(engine, batches, cfg, learner=learner)
    assert isinstance(stats.own, CentredStats)
    assert stats.own.rows_seen == 8.0 and stats.own.last_rows == 4.0       # summed once; the kept one as set
    assert all(isinstance(b.own, Centred) for b in batches)
    assert any(not torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    metrics = stats.metrics(rewards, torch.cat([b.signal for b in batches]), cfg.train, 1.0, learner)
    assert metrics["train/centred_rows"] == 8.0 and "train/loss" in metrics
    assert engine.critic is None                               # it trains nothing beside the policy


class CentredConfig(GrpoConfig):
    """Its settings: grpo's, and one of its own (the tag names it; `implementation`, the learner)."""

    implementation: ClassVar[str] = f"{__name__}:ShrunkCentredGrpo"      # (this module, as it was imported)
    algorithm: Literal["centred"] = Field("centred", exclude=True)
    shrink: float = Field(1.0, gt=0, le=1, description="The centred advantages' scale.")


class ShrunkCentredGrpo(CentredGrpo):
    def prepare(self, engine, batches) -> None:
        super().prepare(engine, batches)
        for b in batches:
            b.advantages = b.own.centred * self.settings.shrink


def test_a_learner_registered_in_a_test_file_is_chosen_by_the_config_and_trains_through_the_stages(tmp_path,
                                                                                                   monkeypatch):
    """Adding a learner is a class, its settings' model and one `register_learner` line (all in this file): then
    train.algorithm names it, train.learner is validated as its settings (their errors keep their place), and
    the train stage (process mode: restore, update, a full checkpoint) trains with it; its metrics reach the
    stored result. Unregistered, the same config is one line naming the registered ones."""
    from tasks.algorithms.learners.registry import learner_class
    from tasks.core import layout
    from tasks.core.config_train import LEARNER_CONFIGS, register_learner
    from tasks.core.errors import UserError
    from tasks.core.store import open_store
    from tasks.generate import generate
    from tasks.reward import reward
    from tasks.train import train

    overrides = ["train.algorithm=centred", "train.learner.shrink=0.5", "train.mode=process", "eval.every=0",
                 "generate.prompts_per_iteration=2", "tracking.dashboard_every=0", f"store.uri={tmp_path}/store"]
    with pytest.raises(UserError, match=r"^config: train.algorithm: expected one of grpo, ppo, vtrace_awr"):
        load_config(TINY, overrides)
    monkeypatch.setattr("tasks.core.config_train.LEARNER_CONFIGS", dict(LEARNER_CONFIGS))     # (undone after)
    register_learner(CentredConfig)                                   # the one line
    with pytest.raises(ValueError, match="implementation"):
        register_learner(GrpoConfig.__base__)
    with pytest.raises(UserError, match=r"^config: train.learner.shrink: input should be less than or equal to 1"):
        load_config(TINY, [*overrides, "train.learner.shrink=2"])
    cfg = load_config(TINY, overrides)
    assert type(cfg.train.learner) is CentredConfig and cfg.train.learner.shrink == 0.5
    assert learner_class(cfg) is ShrunkCentredGrpo
    assert cfg.train.learner.loss_type == "dapo"                          # grpo's settings, inherited
    assert load_config(None, base=cfg.model_dump(mode="json")) == cfg     # (what a trainer process reads back)

    monkeypatch.chdir(tmp_path)
    generate(cfg, 1, layout.behaviour_policy(cfg.run.name, 1, 0))
    reward(cfg, 1)
    train(cfg, 1)
    metrics = open_store(cfg).manifest(layout.checkpoint(cfg.run.name, 1))["meta"]["metrics"]
    assert metrics["train/centred_rows"] == 2 * cfg.generate.num_generations

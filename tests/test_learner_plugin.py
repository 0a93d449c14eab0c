"""A learner is one class: it declares its fields on each micro-batch, its statistics and what it trains beside the
policy, and the update loop (tasks/algorithms/update.py: optimise) carries them without knowing it. The learner
here exists in this file alone: nothing in tasks/ names it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tasks.algorithms.learners.grpo import Grpo
from tasks.algorithms.stats import LearnerStats
from tasks.core.config import load_config
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

"""The demo learns: at a reduced size (8 prompts x 8 completions, 30 iterations, ~15 s) the mean reward of
the random tiny model rises clearly. Seeded, so the curve is the same on every run of this machine kind."""

from __future__ import annotations

import pytest

from tests.conftest import TINY

pytestmark = pytest.mark.slow


def test_reduced_demo_reward_rises(prefect_api, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["run.name=learn", "run.iterations=30", "generate.prompts_per_iteration=8", "train.lr=6e-3",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0"]
    from flows.training import train_flow

    rewards = train_flow(str(TINY), overrides)["reward_mean"]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1                      # a random model almost never names the successor
    assert last >= first + 0.2, rewards     # ... and GRPO alone teaches it

"""The demo learns: at a reduced size (8 prompts x 8 completions, 30 iterations, ~15 s) the mean reward of
the random tiny model rises clearly. Seeded, so the curve is the same on every run of this machine kind."""

from __future__ import annotations

import pytest

from tests.conftest import AT_LENGTH, TINY

pytestmark = pytest.mark.slow


LEARNERS = {"grpo": [],
            # PPO's critic must learn first: its stated budget is the demo's batch (16 prompts) for 40 iterations
            "ppo": ["train.algorithm=ppo", "generate.prompts_per_iteration=16", "run.iterations=40"],
            "vtrace_awr": ["train.algorithm=vtrace_awr"]}


# (make test: GRPO's curve; make drills: every learner's, PPO's alone ~1.5 min of the CI budget)
@pytest.mark.parametrize("learner", ["grpo", pytest.param("ppo", marks=AT_LENGTH),
                                     pytest.param("vtrace_awr", marks=AT_LENGTH)])
def test_reduced_demo_reward_rises(prefect_api, tmp_path, monkeypatch, learner):
    """Each learner (train.algorithm) teaches it: GRPO, PPO with a value head, V-trace + AWR with replay."""
    monkeypatch.chdir(tmp_path)
    overrides = ["run.name=learn", "run.iterations=30", "generate.prompts_per_iteration=8", "train.lr=6e-3",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0", *LEARNERS[learner]]
    from flows.training import train_flow

    rewards = train_flow(str(TINY), overrides)["reward_mean"]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.1                      # a random model almost never names the successor
    assert last >= first + 0.2, rewards     # ... and RL alone teaches it

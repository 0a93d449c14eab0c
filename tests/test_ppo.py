"""PPO with a value model (train.algorithm: ppo; tasks/algorithms/ppo.py, tasks/engines/critic.py): GAE, the
returns, the whitening and the value loss against veRL's formulas on random inputs; environment tokens skipped;
the critic warm-up freezing the policy; and resume: a resident trainer killed mid-run, and process mode, publish
the same policies (the critic is restored exactly, or the advantages, and so the weights, would differ)."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.algorithms.ppo import gae, token_rewards, value_loss, whiten
from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.store import open_store
from tests.conftest import TINY

# ------------------------------------------------------------------------------------------ veRL's formulas
# verl 0.9.1, verl/trainer/ppo/core_algos.py (compute_gae_advantage_return, compute_value_loss with
# loss_agg_mode "token-mean") and verl/utils/torch_functional.py (masked_mean, masked_var, masked_whiten),
# transcribed: veRL itself does not install beside rlflow (ray, tensordict, omegaconf, its own torch pins).


def _verl_masked_mean(values, mask):
    return (values * mask).sum() / (mask.sum() + 1e-8)


def _verl_masked_whiten(values, mask):
    mean = _verl_masked_mean(values, mask)
    var = _verl_masked_mean((values - mean) ** 2, mask)
    var = var * (mask.sum() / (mask.sum() - 1))
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    nextvalues, lastgaelam, reversed_ = 0, 0, []
    for t in reversed(range(token_level_rewards.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        reversed_.append(lastgaelam)
    advantages = torch.stack(reversed_[::-1], dim=1)
    returns = advantages + values
    return _verl_masked_whiten(advantages, response_mask), returns


def _verl_value_loss(vpreds, returns, values, response_mask, cliprange_value):
    vpredclipped = torch.max(torch.min(vpreds, values + cliprange_value), values - cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    vf_loss = 0.5 * _verl_masked_mean(torch.max(vf_losses1, vf_losses2), response_mask)
    return vf_loss, _verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)


def _random_episode_mask(g, rows, width):
    """Model tokens (1) with environment tokens (0) between turns and padding (0) after the end."""
    mask = torch.zeros(rows, width, dtype=torch.float64)
    for i in range(rows):
        end = int(torch.randint(2, width + 1, (1,), generator=g))
        mask[i, :end] = 1.0
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):       # observations inside the episode
            at = int(torch.randint(1, max(end - 1, 2), (1,), generator=g))
            mask[i, at:at + int(torch.randint(1, 4, (1,), generator=g))] = 0.0
        mask[i, end - 1] = 1.0                                             # it ends on a model token
    return mask


@pytest.mark.parametrize("seed, gamma, lam", [(0, 1.0, 0.95), (1, 0.99, 1.0), (2, 0.9, 0.5), (3, 1.0, 0.0)])
def test_gae_returns_whitening_and_value_loss_equal_verls_on_random_inputs(seed, gamma, lam):
    g = torch.Generator().manual_seed(seed)
    rows, width = 12, 40
    mask = _random_episode_mask(g, rows, width)
    scores = torch.randn(rows, generator=g, dtype=torch.float64)
    kl = torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.1
    values = torch.randn(rows, width, generator=g, dtype=torch.float64)
    rewards = token_rewards(scores, mask, kl, kl_coef=0.05)
    last = [int(torch.nonzero(mask[i]).max()) for i in range(rows)]
    want_rewards = -0.05 * kl * mask
    for i in range(rows):
        want_rewards[i, last[i]] += scores[i]
    torch.testing.assert_close(rewards, want_rewards, rtol=0, atol=1e-12)

    adv, ret = gae(rewards, values, mask, gamma, lam)
    total, mean = float(mask.sum()), float((adv * mask).sum() / mask.sum())
    squares = float((((adv - mean) ** 2) * mask).sum())
    ours = whiten(adv, mask, total, mean, squares)
    want_adv, want_ret = _verl_gae(rewards, values, mask, gamma, lam)
    m = mask.bool()
    torch.testing.assert_close(ours[m], want_adv[m], rtol=0, atol=1e-6)
    torch.testing.assert_close(ret[m], want_ret[m], rtol=0, atol=1e-6)

    vpreds = values + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.5
    for clip in (0.2, 0.5):
        loss, clipped = value_loss(vpreds, values, ret, mask, clip, num_tokens=total)
        want_loss, want_frac = _verl_value_loss(vpreds, ret, values, mask, clip)
        assert abs(float(loss) - float(want_loss)) < 1e-6
        assert abs(float(clipped) / total - float(want_frac)) < 1e-6


def test_environment_tokens_never_enter_the_advantages_or_the_returns():
    """Values and rewards on tokens where the mask is 0 (observations) change nothing at the model's tokens."""
    g = torch.Generator().manual_seed(7)
    mask = _random_episode_mask(g, 8, 30)
    rewards = token_rewards(torch.randn(8, generator=g, dtype=torch.float64), mask)
    values = torch.randn(8, 30, generator=g, dtype=torch.float64)
    noise = torch.randn(8, 30, generator=g, dtype=torch.float64) * 100 * (1 - mask)
    adv, ret = gae(rewards, values, mask, 1.0, 0.95)
    adv2, ret2 = gae(rewards + noise, values + noise, mask, 1.0, 0.95)
    m = mask.bool()
    torch.testing.assert_close(adv[m], adv2[m], rtol=0, atol=1e-9)
    torch.testing.assert_close(ret[m], ret2[m], rtol=0, atol=1e-9)


def test_a_row_without_a_reward_gets_no_reward_token():
    mask = torch.ones(2, 3)
    rewards = token_rewards(torch.tensor([float("nan"), 1.0]), mask)
    assert rewards.tolist() == [[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]]




# ------------------------------------------------------------------------------------------ through the stages

ITERATIONS = 4


def _cfg(tmp_path, name: str, mode: str, *extra: str):
    return load_config(TINY, [f"store.uri={tmp_path}/store", f"run.name={name}", f"train.mode={mode}",
                              "train.host=detached", "train.checkpoint_every=2", "generate.prompts_per_iteration=4",
                              "generate.num_generations=4", "train.lr=1e-2", "train.algorithm=ppo", *extra])


def _run(cfg, iterations: int = ITERATIONS, retries: int = 0) -> list[str]:
    from tests.test_resident import _iteration

    for it in range(1, iterations + 1):
        _iteration(cfg, it, retries=retries)
    store = open_store(cfg)
    return [store.manifest(layout.policy(cfg.run.name, it))["files"]["model.safetensors"]["sha256"]
            for it in range(1, iterations + 1)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Process mode, uninterrupted: each iteration restores the trainer (policy, critic, optimizer, RNG) from
    the previous full checkpoint."""
    path = tmp_path_factory.mktemp("ppo-process")
    cfg = _cfg(path, "ref", "process")
    return cfg, _run(cfg)


@pytest.mark.slow
def test_the_critic_is_checkpointed_and_its_metrics_are_logged(reference):
    cfg, policies = reference
    store = open_store(cfg)
    full = store.manifest(layout.checkpoint("ref", ITERATIONS))
    assert layout.CKPT_CRITIC in full["files"] and len(set(policies)) == ITERATIONS
    metrics = full["meta"]["metrics"]
    assert {"train/value_loss", "train/value_mean", "train/return_mean", "train/explained_variance"} <= set(metrics)
    assert "train/advantage_std" not in metrics


@pytest.mark.slow
@pytest.mark.drill
def test_a_resident_ppo_trainer_killed_mid_run_publishes_what_process_mode_publishes(reference, tmp_path,
                                                                                     monkeypatch):
    """Killed while writing iteration 3's lean checkpoint: restored from full-2 (policy, critic, optimizer)
    and iteration 3 replayed; every published policy is process mode's, bit for bit."""
    from tasks.train import finish_trainer

    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    cfg = _cfg(tmp_path, "kill", "resident")
    assert _run(cfg, retries=1) == reference[1]
    assert (tmp_path / "drilled").exists()
    assert finish_trainer(cfg) == ITERATIONS


@pytest.mark.slow
def test_critic_warmup_freezes_the_policy_and_a_separate_critic_trains_too(tmp_path):
    """Two warm-up iterations: the policy published after them is the base model's; the critic moved (a
    separate trunk of its own here); iteration 3 then changes the policy."""
    from safetensors.torch import load_file

    cfg = _cfg(tmp_path, "warm", "process", "train.critic_warmup=2", "train.critic=separate")
    policies = _run(cfg, iterations=3)
    store = open_store(cfg)
    base = load_file(store.local(layout.checkpoint("warm", 2)) / layout.CKPT_MODEL / "model.safetensors")
    from tasks.core import builtin_models
    from tasks.core.models import load_model

    start = load_model(builtin_models.resolve("builtin:tiny-lm"), "float32", "cpu").state_dict()
    assert all(torch.equal(base[k], start[k]) for k in base)
    assert policies[0] == policies[1] != policies[2]
    c1 = load_file(store.local(layout.checkpoint("warm", 1)) / layout.CKPT_CRITIC)
    c2 = load_file(store.local(layout.checkpoint("warm", 2)) / layout.CKPT_CRITIC)
    assert any(k.startswith("trunk.") for k in c1)
    assert any(not torch.equal(c1[k], c2[k]) for k in c1)
    state = json.loads((store.local(layout.checkpoint("warm", 3)) / layout.CKPT_STATE).read_text())
    assert state["iteration"] == 3

"""The V-trace + AWR learner (train.algorithm: vtrace_awr; tasks/algorithms/vtrace.py): V-trace's targets and
advantages against IMPALA's definition (the explicit sums) on random inputs, its on-policy reduction to TD(λ)
returns, the AWR weights and the Lagrange multiplier's direction, value pre-training without an extra forward,
and a resident trainer killed mid-run (with replay of the previous iteration) publishing what process mode does."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.algorithms.ppo import gae
from tasks.algorithms.vtrace import awr_weights, kl_behaviour, lagrange_loss, vtrace
from tasks.core.config import load_config
from tests.conftest import AT_LENGTH, TINY
from tests.test_ppo import _random_episode_mask


def _by_definition(rewards, values, log_rho, mask, gamma, lam, rho_bar, c_bar):
    """IMPALA's eq. (1) on each row's model tokens alone (the environment's removed), by its explicit sums:
    v_s = V_s + Σ_{t≥s} γ^{t-s} (Π_{i=s}^{t-1} c_i) ρ_t δ_t,  A_s = ρ_s (r_s + γ v_{s+1} - V_s)."""
    targets, advantages = torch.zeros_like(values), torch.zeros_like(values)
    for i in range(values.shape[0]):
        idx = torch.nonzero(mask[i]).squeeze(-1).tolist()
        r, v, lr = rewards[i, idx], values[i, idx], log_rho[i, idx]
        n = len(idx)
        rho = [min(rho_bar, math.exp(float(x))) for x in lr]
        c = [lam * min(c_bar, math.exp(float(x))) for x in lr]
        nv = [float(v[t + 1]) if t + 1 < n else 0.0 for t in range(n)]
        delta = [rho[t] * (float(r[t]) + gamma * nv[t] - float(v[t])) for t in range(n)]
        vs = []
        for s in range(n):
            total, trace = float(v[s]), 1.0
            for t in range(s, n):
                total += gamma ** (t - s) * trace * delta[t]
                trace *= c[t]
            vs.append(total)
        for s in range(n):
            following = vs[s + 1] if s + 1 < n else 0.0
            targets[i, idx[s]] = vs[s]
            advantages[i, idx[s]] = rho[s] * (float(r[s]) + gamma * following - float(v[s]))
    return targets, advantages


@pytest.mark.parametrize("seed, gamma, lam, rho_bar, c_bar", [(0, 1.0, 1.0, 1.0, 1.0), (1, 0.99, 0.95, 1.0, 1.0),
                                                              (2, 0.9, 0.8, 2.0, 0.5), (3, 1.0, 0.5, 0.7, 1.3)])
def test_vtrace_equals_impalas_definition_on_random_inputs(seed, gamma, lam, rho_bar, c_bar):
    g = torch.Generator().manual_seed(seed)
    mask = _random_episode_mask(g, 10, 24)
    rewards = torch.randn(10, 24, generator=g, dtype=torch.float64) * mask
    values = torch.randn(10, 24, generator=g, dtype=torch.float64)
    log_rho = torch.randn(10, 24, generator=g, dtype=torch.float64) * 0.7
    got_v, got_a = vtrace(rewards, values, log_rho, mask, gamma, lam, rho_bar, c_bar)
    want_v, want_a = _by_definition(rewards, values, log_rho, mask, gamma, lam, rho_bar, c_bar)
    m = mask.bool()
    torch.testing.assert_close(got_v[m], want_v[m], rtol=0, atol=1e-6)
    torch.testing.assert_close(got_a[m], want_a[m], rtol=0, atol=1e-6)


@pytest.mark.parametrize("lam", [0.0, 0.7, 1.0])
def test_on_policy_vtrace_targets_are_the_td_lambda_returns(lam):
    """π = μ (log ρ = 0), no truncation: v_s is the λ-return, GAE's return; at λ = 1 the Monte Carlo return."""
    g = torch.Generator().manual_seed(11)
    mask = _random_episode_mask(g, 6, 20)
    rewards = torch.randn(6, 20, generator=g, dtype=torch.float64) * mask
    values = torch.randn(6, 20, generator=g, dtype=torch.float64)
    targets, _ = vtrace(rewards, values, torch.zeros_like(values), mask, 0.97, lam, 1.0, 1.0)
    _, returns = gae(rewards, values, mask, 0.97, lam)
    m = mask.bool()
    torch.testing.assert_close(targets[m], returns[m], rtol=0, atol=1e-9)
    if lam == 1.0:
        row = torch.nonzero(mask[0]).squeeze(-1).tolist()
        mc = sum(0.97 ** k * float(rewards[0, t]) for k, t in enumerate(row))
        assert abs(float(targets[0, row[0]]) - mc) < 1e-9


def test_awr_weights_the_kl_estimate_and_the_multipliers_direction():
    adv = torch.tensor([-2.0, 0.0, 1.0, 10.0])
    assert torch.allclose(awr_weights(adv, 0.5, 20.0), torch.tensor([math.exp(-4), 1.0, math.exp(2), 20.0]))
    logp, behaviour = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    r = torch.exp(logp - behaviour)
    assert torch.allclose(kl_behaviour(logp, behaviour), r - 1 - (logp - behaviour))
    assert float(kl_behaviour(behaviour, behaviour).abs().max()) == 0.0
    for kl, grows in ((0.5, True), (0.001, False)):             # above the target η grows, below it shrinks
        eta_raw = torch.zeros((), requires_grad=True)
        loss, eta = lagrange_loss(eta_raw, torch.tensor(kl), target=0.01)
        loss.backward()
        assert (eta_raw.grad < 0) == grows                      # (gradient descent moves against the gradient)
        assert abs(float(eta) - math.log(2)) < 1e-6


def _engine_and_batches(*overrides: str):
    from tasks.algorithms.batching import prepare_batches
    from tasks.core.contracts import Rollout
    from tasks.engines.torch_engine import TorchEngine

    cfg = load_config(TINY, ["train.algorithm=vtrace_awr", "train.micro_batch_size=4", *overrides])
    engine = TorchEngine.open(cfg, None, None)
    g = torch.Generator().manual_seed(5)
    records = [Rollout(group=i // 4, row=i // 4, prompt="p", prompt_ids=[3, 4, 5], completion="c",
                       completion_ids=torch.randint(10, 60, (5,), generator=g).tolist(),
                       logprobs=(-torch.rand(5, generator=g) * 3).tolist(), truncated=False,
                       reward=float(i % 3 == 0)) for i in range(8)]
    rewards = torch.tensor([r.reward for r in records])
    return cfg, engine, prepare_batches(records, rewards, engine.tokenizer.pad_token_id, cfg.train, engine.device)


def _counted(forward, calls: list[int]):
    def counting(*args, **kwargs):
        calls.append(1)
        return forward(*args, **kwargs)
    return counting


def test_value_pretraining_fits_the_head_on_detached_states_without_another_forward():
    """value_epochs steps of the head alone: the model runs exactly as often as with none (the no-gradient
    forward and the passes), the head moves further, and the policy's first pass starts from the same weights."""
    from tasks.algorithms.update import optimise

    counts = {}
    heads = {}
    for epochs in (0, 5):
        cfg, engine, batches = _engine_and_batches(f"train.value_epochs={epochs}")
        before = engine.critic.head.summary.weight.detach().clone()
        calls: list[int] = []
        engine.model.forward = _counted(engine.model.forward, calls)
        optimise(engine, batches, cfg, 1)
        counts[epochs] = len(calls)
        heads[epochs] = float((engine.critic.head.summary.weight.detach() - before).norm())
    # 2 micro-batches: the forward without gradients + a pass, each a model call for the group's shared prompt and
    # one for the completions (tasks/algorithms/logprobs.py: shared_prompt_forward)
    assert counts[0] == counts[5] == 2 * 2 * 2
    assert heads[5] > heads[0] > 0


@pytest.mark.parametrize("algorithm", ["ppo", "vtrace_awr"])
def test_the_environments_tokens_never_move_a_value_learner(algorithm):
    """Multi-turn rollouts: whatever the behaviour logprobs at the environment's tokens (mask 0) say, a whole
    update (the critic's values, GAE or V-trace, the passes, value pre-training) ends at the same weights."""
    from tasks.algorithms.batching import prepare_batches
    from tasks.algorithms.update import optimise
    from tasks.core.contracts import Rollout
    from tasks.engines.torch_engine import TorchEngine

    def trained(env_logprob: float) -> dict[str, torch.Tensor]:
        cfg = load_config(TINY, [f"train.algorithm={algorithm}", "train.num_iterations=2", "train.beta=0.05",
                                 "train.replay_iterations=1"])
        engine = TorchEngine.open(cfg, None, None)
        records = [Rollout(group=i // 2, row=i // 2, prompt="p", prompt_ids=[5, 6, 7], completion="",
                           completion_ids=[11 + i, 12, 13, 14, 15 + i, 16],
                           logprobs=[-1.0, -0.5, env_logprob, env_logprob, -2.0, -0.1], truncated=False,
                           mask=[1, 1, 0, 0, 1, 1], reward=float(i % 2)) for i in range(4)]
        rewards = torch.tensor([r.reward for r in records])
        optimise(engine, prepare_batches(records, rewards, engine.tokenizer.pad_token_id, cfg.train, "cpu"), cfg)
        return {**{f"policy.{k}": v for k, v in engine.model.state_dict().items()},
                **{f"critic.{k}": v for k, v in engine.critic.state_dict().items()}}

    a, b = trained(0.0), trained(-7.5)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------ resume

@AT_LENGTH
@pytest.mark.slow
@pytest.mark.drill
def test_a_resident_vtrace_awr_trainer_killed_mid_run_publishes_what_process_mode_publishes(tmp_path, monkeypatch):
    """With the previous iteration's rollouts replayed: restored from full-2 (policy, critic with its
    multiplier, optimizer), iteration 3 replayed; every policy equals process mode's, bit for bit."""
    from tasks.train import finish_trainer
    from tests.test_ppo import _cfg, _run

    want = _run(_cfg(tmp_path / "process", "ref", "process", "train.algorithm=vtrace_awr"))
    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    cfg = _cfg(tmp_path / "resident", "kill", "resident", "train.algorithm=vtrace_awr")
    assert _run(cfg, retries=1) == want
    assert (tmp_path / "drilled").exists()
    assert finish_trainer(cfg) == 4


@pytest.mark.slow
def test_off_line_rollouts_from_another_run_join_every_update(tmp_path):
    """train.offline_rollouts: another run's scored rollouts (same store) are trained on beside this run's own
    and its replayed iteration; a key with none is one line."""
    from tasks.core.errors import UserError
    from tasks.core.store import open_store
    from tasks.generate import generate
    from tasks.reward import reward
    from tasks.train import train
    from tests.test_ppo import _cfg
    from tests.test_resident import _iteration

    source = _cfg(tmp_path, "source", "process", "train.algorithm=vtrace_awr")
    _iteration(source, 1)
    key = "source/iter-000001/rewards"
    cfg = _cfg(tmp_path, "learner", "process", "train.algorithm=vtrace_awr", f"train.offline_rollouts=[{key}]")
    _iteration(cfg, 1)
    _iteration(cfg, 2)
    store = open_store(cfg)
    rows = [store.manifest(f"learner/trainer/ckpt-00000{it}")["meta"]["metrics"]["train/rows"] for it in (1, 2)]
    assert rows == [16 + 16, 16 + 16 + 16]              # off-line + (replayed) + this iteration's
    missing = _cfg(tmp_path, "other", "process", "train.algorithm=vtrace_awr",
                   "train.offline_rollouts=[source/iter-000009/rewards]")
    generate(missing, 1, "base")
    reward(missing, 1)
    with pytest.raises(UserError, match=r"^train.learner.offline_rollouts: source/iter-000009/rewards: no scored "
                                        r"rollouts at "):
        train(missing, 1)
    with pytest.raises(UserError, match="offline_rollouts: off-line data needs an off-policy learner"):
        load_config(TINY, [f"train.offline_rollouts=[{key}]"])

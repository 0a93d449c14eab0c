"""Our GRPO-family losses equal TRL's (GRPOTrainer._compute_loss, TRL 1.16) — loss and gradient — on the
same random inputs: logprobs, old and reference logprobs, advantages and ragged completion masks.

TRL's trainer is built once on the tiny model; its logprob computation is replaced by the tensors under test,
so what is compared is exactly the loss arithmetic of both sides, for every loss type, both importance
sampling levels, beta 0 and > 0, and two-sided clipping."""

from __future__ import annotations

import itertools

import pytest
import torch

from tasks.config import TrainConfig
from tasks.loss import aggregate, per_token_loss

trl = pytest.importorskip("trl")

B, T = 6, 7
LOSS_TYPES = ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    from datasets import Dataset
    from tasks.tiny_model import build
    from trl import GRPOConfig, GRPOTrainer

    tmp = tmp_path_factory.mktemp("trl")
    path = build(tmp / "tiny")
    args = GRPOConfig(output_dir=str(tmp / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=B,
                      num_generations=B, max_completion_length=T, beta=0.0, report_to=[], loss_type="dapo")
    trainer = GRPOTrainer(model=str(path), args=args, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          train_dataset=Dataset.from_dict({"prompt": ["a=", "b="]}))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1   # one micro-batch per optimiser step
    return trainer


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 4
    old = logp + 0.3 * torch.randn(B, T, generator=g)          # policy has moved: ratios spread around 1
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    adv = torch.randn(B, generator=g)
    return logp, old, ref, mask, adv


def _trl_loss(trainer, tc: TrainConfig, logp, old, ref, mask, adv):
    leaf = logp.clone().requires_grad_()
    trainer._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros(B, T), None)
    trainer.loss_type = tc.loss_type
    trainer.importance_sampling_level = tc.importance_sampling_level
    trainer.beta = tc.beta
    trainer.epsilon_low = tc.epsilon
    trainer.epsilon_high = tc.epsilon_high if tc.epsilon_high is not None else tc.epsilon
    trainer.args.delta = tc.delta
    trainer.args.use_bias_correction_kl = tc.use_bias_correction_kl
    trainer.args.sapo_temperature_pos = tc.sapo_temperature_pos
    trainer.args.sapo_temperature_neg = tc.sapo_temperature_neg
    inputs = dict(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                  completion_ids=torch.ones(B, T, dtype=torch.long), completion_mask=mask, advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=mask.sum())
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def _our_loss(tc: TrainConfig, logp, old, ref, mask, adv):
    leaf = logp.clone().requires_grad_()
    ptl, _, _ = per_token_loss(leaf, old, adv, mask, tc, ref_logp=ref if tc.beta else None)
    loss = aggregate(ptl, mask, tc.loss_type, float(mask.sum()), B, T)
    loss.backward()
    return loss.detach(), leaf.grad


CASES = [dict(loss_type=lt, importance_sampling_level=lvl, beta=beta)
         for lt, lvl, beta in itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04])]
CASES += [dict(loss_type=lt, beta=0.04, use_bias_correction_kl=False) for lt in LOSS_TYPES]
CASES += [dict(loss_type="grpo", delta=1.5, epsilon_high=0.28), dict(loss_type="dapo", delta=1.2, beta=0.1),
          dict(loss_type="cispo", epsilon_high=2.0), dict(loss_type="sapo", sapo_temperature_pos=0.7)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_and_gradient_equal_trl(trl_trainer, case):
    tc = TrainConfig(**case)
    if tc.loss_type == "cispo" and tc.epsilon_high is None:
        tc = tc.model_copy(update={"epsilon_high": 5.0})    # TRL's fallback would be epsilon; compare like for like
    for seed in range(3):
        tensors = _inputs(seed)
        ours, our_grad = _our_loss(tc, *tensors)
        theirs, their_grad = _trl_loss(trl_trainer, tc, *tensors)
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-6), (float(ours), float(theirs))
        assert torch.allclose(our_grad, their_grad, atol=1e-6, rtol=1e-6)

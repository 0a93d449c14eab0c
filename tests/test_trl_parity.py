"""Our GRPO-family losses equal TRL's (GRPOTrainer._compute_loss, TRL 1.16) — loss and gradient — on the
same random inputs: logprobs, old and reference logprobs, advantages and ragged completion masks.

TRL's trainer is built once on the tiny model; its logprob computation is replaced by the tensors under test,
so what is compared is exactly the loss arithmetic of both sides, for every loss type, both importance
sampling levels, beta 0 and > 0, and two-sided clipping."""

from __future__ import annotations

import itertools

import pytest
import torch

from tasks.algorithms.loss import aggregate, per_token_loss
from tasks.core.config import TrainConfig

B, T = 6, 7
LOSS_TYPES = ["grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo"]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tasks.core.builtin_models import build

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
    lc = tc.learner
    trainer.loss_type = lc.loss_type
    trainer.importance_sampling_level = lc.importance_sampling_level
    trainer.beta = tc.beta
    trainer.epsilon_low = lc.epsilon
    trainer.epsilon_high = lc.epsilon_high if lc.epsilon_high is not None else lc.epsilon
    trainer.args.delta = lc.delta
    trainer.args.use_bias_correction_kl = lc.use_bias_correction_kl
    trainer.args.sapo_temperature_pos = lc.sapo_temperature_pos
    trainer.args.sapo_temperature_neg = lc.sapo_temperature_neg
    inputs = dict(prompt_ids=torch.ones(B, 2, dtype=torch.long), prompt_mask=torch.ones(B, 2, dtype=torch.long),
                  completion_ids=torch.ones(B, T, dtype=torch.long), completion_mask=mask, advantages=adv,
                  old_per_token_logps=old, ref_per_token_logps=ref, num_items_in_batch=mask.sum())
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def _our_loss(tc: TrainConfig, logp, old, ref, mask, adv):
    leaf = logp.clone().requires_grad_()
    ptl, _, _ = per_token_loss(leaf, old, adv, mask, tc.learner, tc.beta, ref_logp=ref if tc.beta else None)
    loss = aggregate(ptl, mask, tc.learner.loss_type, float(mask.sum()), B, T)
    loss.backward()
    return loss.detach(), leaf.grad


CASES = [dict(loss_type=lt, importance_sampling_level=lvl, beta=beta)
         for lt, lvl, beta in itertools.product(LOSS_TYPES, ["token", "sequence"], [0.0, 0.04])]
CASES += [dict(loss_type=lt, beta=0.04, use_bias_correction_kl=False) for lt in LOSS_TYPES]
CASES += [dict(loss_type="grpo", delta=1.5, epsilon_high=0.28), dict(loss_type="dapo", delta=1.2, beta=0.1),
          dict(loss_type="cispo", epsilon_high=2.0), dict(loss_type="sapo", sapo_temperature_pos=0.7)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_loss_and_gradient_equal_trl(trl_trainer, case):
    learner = {k: v for k, v in case.items() if k != "beta"}     # the surrogate's settings: train.learner's
    if learner["loss_type"] == "cispo" and learner.get("epsilon_high") is None:
        learner["epsilon_high"] = 5.0        # TRL's fallback would be epsilon; compare like for like
    tc = TrainConfig(beta=case.get("beta", 0.0), learner=learner)
    for seed in range(3):
        tensors = _inputs(seed)
        ours, our_grad = _our_loss(tc, *tensors)
        theirs, their_grad = _trl_loss(trl_trainer, tc, *tensors)
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=1e-6), (float(ours), float(theirs))
        assert torch.allclose(our_grad, their_grad, atol=1e-6, rtol=1e-6)


# ---- advantages: TRL's _generate_and_score_completions, generation replaced by fixed completions ----------

N_GROUPS, GROUP = 3, 4
WEIGHTS = {"correct": 1.0, "format": 0.5}


def _reward_table(seed: int) -> list[dict[str, float | None]]:
    """Two reward functions; some scores missing (None), one completion with every score missing, one group
    with a single scored completion, one group with equal rewards (std 0)."""
    g = torch.Generator().manual_seed(seed)
    table = []
    for i in range(N_GROUPS * GROUP):
        correct = float(torch.randint(0, 2, (1,), generator=g))
        fmt = round(float(torch.rand(1, generator=g)), 3)
        table.append({"correct": correct, "format": None if i % 5 == 3 else fmt})
    table[1] = {"correct": None, "format": None}                         # unscorable
    for i in range(4, 8):                                                 # group 1: equal rewards
        table[i] = {"correct": 1.0, "format": 0.25}
    for i in range(9, 12):                                                # group 2: one scored completion
        table[i] = {"correct": None, "format": None}
    return table


@pytest.fixture(scope="module")
def trl_scoring_trainer(tmp_path_factory):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tasks.core.builtin_models import build

    table_ref: dict[str, list] = {"table": []}

    def correct(completions, **kw):
        return [table_ref["table"][int(c)]["correct"] for c in completions]

    def format(completions, **kw):  # noqa: A001 - the reward function's name is its metric name
        return [table_ref["table"][int(c)]["format"] for c in completions]

    tmp = tmp_path_factory.mktemp("trl-adv")
    path = build(tmp / "tiny")
    n = N_GROUPS * GROUP
    args = GRPOConfig(output_dir=str(tmp / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=n,
                      num_generations=GROUP, max_completion_length=3, beta=0.0, report_to=[], loss_type="dapo",
                      reward_weights=[WEIGHTS["correct"], WEIGHTS["format"]])
    trainer = GRPOTrainer(model=str(path), args=args, reward_funcs=[correct, format],
                          train_dataset=Dataset.from_dict({"prompt": ["a=", "b=", "c="]}))
    trainer.model.train()

    def fixed_generation(prompts):
        # prompt ids, completion ids (ending in EOS), no tool mask, completion texts = row index, no logprobs
        eos = trainer.eos_token_ids[0]
        return ([[5, 6]] * n, [[7, 8, eos]] * n, None, [str(i) for i in range(n)], None, {}, None, None)

    trainer._generate = fixed_generation
    return trainer, table_ref


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(trl_scoring_trainer, scale):
    from tasks.algorithms.advantage import group_advantages
    from tasks.scoring.functions import combine

    trainer, table_ref = trl_scoring_trainer
    trainer.scale_rewards = scale
    for seed in range(3):
        table_ref["table"] = _reward_table(seed)
        inputs = [{"prompt": "abc"[i // GROUP] + "="} for i in range(N_GROUPS * GROUP)]
        theirs = trainer._generate_and_score_completions(inputs)["advantages"]
        ours = group_advantages(combine(table_ref["table"], WEIGHTS, "sum"), GROUP, scale)
        assert torch.allclose(ours.float(), theirs, atol=1e-6), (ours, theirs)     # (ours: float64, then float32)
        assert ours[1] == 0 and (ours[8:] == 0).all()    # unscorable row; a group with one scored completion

"""GRPO math (advantages, loss aggregation) and the train stage's batching: micro-batches accumulate to the
full-batch gradient exactly; beta > 0 and several optimiser passes per batch run and behave as defined."""

from __future__ import annotations

import math

import pytest
import torch

from tasks.algorithms.advantage import advantages, group_advantages
from tasks.algorithms.batching import pad_batch
from tasks.algorithms.logprobs import completion_logprobs
from tasks.algorithms.loss import aggregate, behaviour_correction, per_token_loss
from tasks.core import layout
from tasks.core.config import GrpoConfig, load_config
from tasks.core.models import base_path, load_model, load_tokenizer
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.scoring.functions import combine
from tasks.train import train
from tests.conftest import TINY


def test_group_advantages_match_the_definition():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(r, 4, "group")
    g = r[:4]
    assert torch.allclose(adv[:4], (g - g.mean()) / (g.std() + 1e-4))      # Bessel-corrected std
    assert torch.equal(adv[4:], torch.zeros(4))                             # no signal in a flat group
    assert torch.allclose(group_advantages(r, 4, "none")[:4], g - g.mean())
    assert torch.allclose(group_advantages(r, 4, "batch")[:4], (g - g.mean()) / (r.std() + 1e-4))


def _rloo_reference(grouped: list[list[float]]) -> list[float]:
    """RLOO as OpenRLHF writes it: baseline = (sum - r) / (n - 1), per group, in plain Python."""
    out = []
    for g in grouped:
        out += [r - (sum(g) - r) / (len(g) - 1) for r in g]
    return out


def _whiten(xs: list[float]) -> list[float]:
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return [(x - m) / (sd + 1e-4) for x in xs]


def test_rloo_and_reinforce_pp_advantages_match_their_definitions():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(24, generator=gen)
    grouped = r.view(6, 4).tolist()
    assert torch.allclose(advantages(r, 4, "rloo"), torch.tensor(_rloo_reference(grouped)), atol=1e-6)
    assert torch.allclose(advantages(r, 4, "reinforce_pp"), torch.tensor(_whiten(r.tolist())), atol=1e-6)
    centred = [x - sum(g) / len(g) for g in grouped for x in g]
    assert torch.allclose(advantages(r, 4, "reinforce_pp_baseline"), torch.tensor(_whiten(centred)), atol=1e-6)
    # RLOO is GRPO's unscaled advantage times n/(n-1)
    assert torch.allclose(advantages(r, 4, "rloo"), group_advantages(r, 4, "none") * 4 / 3, atol=1e-6)
    assert torch.equal(advantages(r, 4, "group", "batch"), group_advantages(r, 4, "batch"))


@pytest.mark.parametrize("kind", ["rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_missing_rewards_get_zero_advantage_and_enter_no_baseline(kind):
    r = torch.tensor([1.0, math.nan, 0.0, 0.5, math.nan, math.nan, 2.0, 0.0])
    adv = advantages(r, 4, kind)
    assert adv[1] == 0 and adv[4] == 0 and adv[5] == 0
    present = [1.0, 0.0, 0.5, 2.0, 0.0]
    if kind == "rloo":      # the baseline of each completion is the mean of the others present in its group
        want = [1.0 - 0.25, 0.0 - 0.75, 0.5 - 0.5, 2.0 - 0.0, 0.0 - 2.0]
    elif kind == "reinforce_pp":
        want = _whiten(present)
    else:
        want = _whiten([1.0 - 0.5, 0.0 - 0.5, 0.5 - 0.5, 2.0 - 1.0, 0.0 - 1.0])
    assert torch.allclose(adv[[0, 2, 3, 6, 7]], torch.tensor(want), atol=1e-6)
    assert advantages(torch.tensor([1.0, math.nan, math.nan, math.nan]), 4, "rloo").tolist() == [0.0] * 4


def test_missing_rewards_get_zero_advantage_and_leave_group_stats():
    r = combine([{"a": 1.0, "b": None}, {"a": None, "b": None}, {"a": 0.0, "b": 1.0}], {"a": 1.0, "b": 2.0})
    assert r[0] == 1.0 and math.isnan(r[1]) and r[2] == 2.0
    adv = group_advantages(r, 3, "none")
    assert adv.tolist() == [-0.5, 0.0, 0.5]


def test_reward_aggregate_mean_averages_the_functions_that_scored():
    scores = [{"a": 1.0, "b": 0.0}, {"a": None, "b": 1.0}]
    assert combine(scores, {"a": 1.0, "b": 2.0}, "mean").tolist() == [0.5, 2.0]
    assert combine(scores, {"a": 1.0, "b": 2.0}, "sum").tolist() == [1.0, 2.0]


def test_behaviour_correction_truncates_or_masks_per_token_or_sequence():
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]]))
    beh = torch.log(torch.tensor([[0.1, 0.5, 0.5], [0.9, 0.45, 0.9]]))   # generator put less mass on some tokens
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    tok = behaviour_correction(old, beh, mask, "token_truncate", 3.0)
    assert torch.allclose(tok, torch.tensor([[3.0, 1.0, 1.0], [1.0, 2.0, 1.0]]))          # 5.0 capped at 3
    assert torch.allclose(behaviour_correction(old, beh, mask, "token_mask", 3.0),
                          torch.tensor([[0.0, 1.0, 1.0], [1.0, 2.0, 1.0]]))              # 5.0 dropped
    seq = behaviour_correction(old, beh, mask, "sequence_truncate", 3.0)
    assert seq.shape == (2, 1) and torch.allclose(seq, torch.tensor([[3.0], [2.0]]))
    assert torch.allclose(behaviour_correction(old, beh, mask, "sequence_mask", 3.0), torch.tensor([[0.0], [2.0]]))


def test_loss_aggregation():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, ratio, kl = per_token_loss(logp, logp.detach(), adv, mask, GrpoConfig())
    assert torch.equal(ratio, torch.ones_like(ratio)) and kl is None
    assert float(aggregate(loss, mask, "dapo", 5.0, 2, 3)) == pytest.approx((-2 + 3) / 5)
    assert float(aggregate(loss, mask, "grpo", 5.0, 2, 3)) == pytest.approx((-1 + 1) / 2)
    assert float(aggregate(loss, mask, "dr_grpo", 5.0, 2, 3)) == pytest.approx((-2 + 3) / (2 * 3))
    # Clipping: a ratio above 1+eps with positive advantage stops contributing gradient.
    new = logp + 0.5
    loss, ratio, _ = per_token_loss(new.requires_grad_(), logp, torch.tensor([1.0, 1.0]), mask,
                                    GrpoConfig(epsilon_high=0.28))
    loss.sum().backward()
    assert torch.all(new.grad == 0)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"])
def test_micro_batches_accumulate_to_the_full_batch_gradient(loss_type):
    cfg = load_config(TINY, [])
    model = load_model(base_path(cfg))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (int(n),), generator=g).tolist() for n in torch.randint(2, 6, (8,), generator=g)]
    comps = [torch.randint(3, 90, (int(n),), generator=g).tolist() for n in torch.randint(1, 5, (8,), generator=g)]
    adv = torch.randn(8, generator=g)

    def grads(micro: int):
        model.zero_grad()
        total_tokens = float(sum(len(c) for c in comps))
        for s in range(0, 8, micro):
            ids, attn, pos, mask = pad_batch(prompts[s:s + micro], comps[s:s + micro], 0)
            logp, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 1.0)
            loss, _, _ = per_token_loss(logp, logp.detach(), adv[s:s + micro], mask, GrpoConfig(loss_type=loss_type))
            aggregate(loss, mask, loss_type, total_tokens, 8, 4).backward()
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(grads(8), grads(3)):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5)


def test_padding_does_not_change_logprobs():
    """Left-padded prompts with real-token position ids give each row the logprobs it has alone."""
    cfg = load_config(TINY, [])
    model = load_model(base_path(cfg))
    rows = [([5, 6, 7, 8], [9, 10]), ([11], [12, 13, 14])]
    ids, attn, pos, mask = pad_batch([p for p, _ in rows], [c for _, c in rows], 0)
    batch, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7)
    for b, (p, c) in enumerate(rows):
        i1, a1, p1, m1 = pad_batch([p], [c], 0)
        alone, _ = completion_logprobs(model, i1, a1, p1, m1.shape[1], 0.7)
        assert torch.allclose(batch[b, :len(c)], alone[0], atol=1e-5)


def test_the_entropy_statistic_is_the_distributions_own_a_slice_at_a_time_and_keeps_no_graph(monkeypatch):
    """with_entropy: -sum p log p of the whole distribution at each completion position, the same whatever slice of
    positions is computed at once (ENTROPY_SLICE), and detached: a logged statistic holds no (Lc, V) tensor through
    the backward; the logprobs still carry the gradient."""
    from tasks.algorithms import logprobs as lp

    cfg = load_config(TINY, [])
    model = load_model(base_path(cfg))
    g = torch.Generator().manual_seed(3)
    prompts, comps = _groups(g, [4, 6], 2, completion=(7, 12))
    ids, attn, pos, mask = pad_batch(prompts, comps, 0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -mask.shape[1] - 1:-1]
        whole = torch.log_softmax(logits.float() / 0.7, -1)
        want = -(whole.exp() * whole).sum(-1)
    for slice_ in (lp.ENTROPY_SLICE, 3, 1):
        monkeypatch.setattr(lp, "ENTROPY_SLICE", slice_)
        logp, entropy = completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7, with_entropy=True,
                                            share_prompts=False)
        assert logp.requires_grad and not entropy.requires_grad and entropy.grad_fn is None
        assert entropy.shape == mask.shape and torch.allclose(entropy * mask, want * mask, atol=1e-5)


def _groups(g: torch.Generator, lengths: list[int], per_prompt: int, completion: tuple[int, int] = (1, 6)):
    """Prompts of the given lengths, each with `per_prompt` completions (a GRPO group), as token id lists."""
    prompts, comps = [], []
    for n in lengths:
        p = torch.randint(3, 90, (n,), generator=g).tolist()
        for _ in range(per_prompt):
            prompts.append(p)
            length = int(torch.randint(*completion, (1,), generator=g))
            comps.append(torch.randint(3, 90, (length,), generator=g).tolist())
    return prompts, comps


@pytest.mark.parametrize("with_hidden", [False, True])
def test_a_shared_prompt_forward_gives_the_full_forwards_logprobs_and_gradients(with_hidden):
    """train.share_prompts: groups of rows sharing a prompt (left-padded to different lengths, with a lone prompt
    among them) give the logprobs, entropies, hidden states and gradients of one full forward, up to rounding;
    the prompt runs once per group (the model sees the distinct prompts, then every row's completion)."""
    from tasks.algorithms.logprobs import prompt_groups

    cfg = load_config(TINY, [])
    model = load_model(base_path(cfg))
    g = torch.Generator().manual_seed(1)
    prompts, comps = _groups(g, [7, 3, 5], 4)
    lone, lone_c = _groups(g, [6], 1)
    ids, attn, pos, mask = pad_batch(prompts + lone, comps + lone_c, 0)
    first, inverse = prompt_groups(ids, mask.shape[1])
    assert len(first) == 4
    assert inverse.tolist() == [int(inverse[i]) for i in (0, 4, 8) for _ in range(4)] + [int(inverse[12])]

    def run(share: bool):
        model.zero_grad()
        out = completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7, with_entropy=True,
                                  with_hidden=with_hidden, share_prompts=share)
        (out[0] * mask).sum().backward()
        return [o.detach() for o in out], [p.grad.clone() for p in model.parameters()]

    (full, full_grads), (shared, shared_grads) = run(False), run(True)
    for a, b in zip(full, shared):
        assert torch.allclose(a * mask.unsqueeze(-1) if a.dim() == 3 else a * mask,
                              b * mask.unsqueeze(-1) if b.dim() == 3 else b * mask, atol=1e-5)
    for a, b in zip(full_grads, shared_grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)

    calls = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: calls.append(kwargs["input_ids"].shape) or forward(*args, **kwargs)
    completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7)
    assert calls == [(4, ids.shape[1] - mask.shape[1] - 1), (13, mask.shape[1] + 1)]


def test_sampling_fills_each_prompts_cache_once_and_samples_the_same():
    """generate.share_prompts: the hf sampler prefills each prompt once for its n samples; the samples, their
    behaviour logprobs and the greedy completions equal transformers' own expansion (each prompt n times)."""
    from tasks.core.contracts import SamplingParams
    from tasks.engines.hf import hf_generate

    cfg = load_config(TINY, [])
    model, tok = load_model(base_path(cfg)).eval(), load_tokenizer(base_path(cfg))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("c=", "hello x=", "abcdefg=")]
    for temperature in (0.7, 0.0):
        params = SamplingParams(n=4, max_new_tokens=6, temperature=temperature, top_p=1.0, seed=5)
        shared = hf_generate(model, tok, prompts, params, 2, share_prompts=True)
        expanded = hf_generate(model, tok, prompts, params, 2, share_prompts=False)
        assert [s.completion_ids for s in shared] == [s.completion_ids for s in expanded]
        for a, b in zip(shared, expanded):
            assert a.prompt == b.prompt and a.truncated == b.truncated
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) < 1e-5
    calls = []
    forward = model.forward
    model.forward = lambda *args, **kwargs: calls.append(kwargs["input_ids"].shape) or forward(*args, **kwargs)
    hf_generate(model, tok, prompts[:2], SamplingParams(n=4, max_new_tokens=3, temperature=0.7, top_p=1.0, seed=5), 2)
    assert calls[0] == (2, len(prompts[1]) - 1) and calls[1] == (8, 1)   # 2 prompts prefilled once, then 8 rows
    model.forward = forward
    greedy = SamplingParams(n=2, max_new_tokens=6, temperature=0.0, top_p=1.0, seed=0)
    twice = hf_generate(model, tok, prompts, greedy, 3)
    assert all(twice[i].completion_ids == twice[i + 1].completion_ids for i in range(0, len(twice), 2))


def test_train_with_reference_kl_and_several_passes(tmp_path):
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=kl", "generate.prompts_per_iteration=4",
                             "generate.num_generations=4", "train.beta=0.1", "train.num_iterations=3",
                             "train.loss_type=grpo", "train.micro_batch_size=5", "train.lr=1e-2",
                             'reward.functions=[{"fn": "tasks.rewards.demo:stops_reward"}]'])
    generate(cfg, 1, layout.BASE)
    reward(cfg, 1)
    m = train(cfg, 1)["metrics"]
    assert m["train/kl_ref"] == pytest.approx(0.0, abs=1e-7)             # pass 1 of iteration 1: policy = reference
    assert m["train/mismatch_kl"] < 1e-3                                   # same weights: only numerics differ
    assert m["train/ratio_max"] > 1.0 or m["train/ratio_min"] < 1.0        # passes 2-3 are off the old policy
    publish(cfg, 1)
    generate(cfg, 2, layout.policy("kl", 1))
    reward(cfg, 2)
    m2 = train(cfg, 2)["metrics"]
    assert m2["train/kl_ref"] > 1e-6                # three steps of lr 1e-2 later the policy left the reference
    assert 0.0 <= m["train/clip_region"] <= 1.0
    assert m["train/ratio_min"] <= m["train/ratio_mean"] <= m["train/ratio_max"]
    assert m["train/clip_region"] == m["train/clip_low"] + m["train/clip_high"]


def test_gradient_checkpointing_recomputes_each_layer_and_gives_the_same_logprobs_and_gradients():
    """train.gradient_checkpointing: the engine's model recomputes each decoder layer in the backward (a layer's
    forward runs twice per step, once without it) for the same logprobs and gradients; its training forward runs
    every row whole (no KV cache to share under checkpointing) without turning prompt sharing off for the model
    class: its no-grad passes still run each prompt once."""
    from tasks.algorithms import logprobs as lp
    from tasks.engines.torch_engine import TorchEngine

    cfg = load_config(TINY, ["train.gradient_checkpointing=true"])
    engine = TorchEngine.open(cfg, None, None)
    recomputing, plain = engine.model, load_model(base_path(cfg)).train()
    assert recomputing.is_activation_checkpointing and not plain.is_activation_checkpointing
    g = torch.Generator().manual_seed(3)
    prompts, comps = _groups(g, [7, 5], 3)
    ids, attn, pos, mask = pad_batch(prompts, comps, 0)

    def step(model):
        layer_calls = []
        hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: layer_calls.append(1))
        model.zero_grad()
        logp, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7)
        (logp * mask).sum().backward()
        hook.remove()
        return logp.detach(), [p.grad.clone() for p in model.parameters()], len(layer_calls)

    (want, want_grads, plain_calls), (got, got_grads, calls) = step(plain), step(recomputing)
    assert torch.allclose(want * mask, got * mask, atol=1e-5)
    for a, b in zip(want_grads, got_grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert plain_calls == 2 and calls == 2   # plain: the prompts, then the rows; recomputing: all at once, twice
    assert lp._CAN_SHARE.get(type(recomputing), True)

    seen = []
    forward = recomputing.forward
    recomputing.forward = lambda *args, **kwargs: seen.append(kwargs["input_ids"].shape[0]) or forward(*args, **kwargs)
    with torch.no_grad():
        completion_logprobs(recomputing.eval(), ids, attn, pos, mask.shape[1], 0.7)
    assert seen == [2, 6]


@pytest.mark.parametrize("loss_type,passes,more", [("dapo", 1, []), ("grpo", 2, []), ("cispo", 1, []),
                                                   ("sapo", 1, []), ("dr_grpo", 2, []),
                                                   ("grpo", 2, ["train.importance_sampling_level=sequence"])])
def test_rows_of_advantage_zero_skip_their_backward_and_the_update_is_the_same(loss_type, passes, more, monkeypatch):
    """A constant group's rows (advantage 0) and a row whose tokens are all masked add nothing to the gradient:
    the torch engine runs the first without gradients (for the statistics) and skips the second; the gradient of
    each pass, the weights and every train/* statistic equal an update that trains every row (to float rounding).
    A batch with no row to learn from still steps as before (AdamW's weight decay moves the weights). A subclass
    of the learner that adds a term to the loss trains every row (it does not inherit the skip)."""
    from tasks.algorithms import update
    from tasks.algorithms.batching import prepare_batches
    from tasks.algorithms.learners.grpo import Grpo
    from tasks.algorithms.stats import UpdateStats
    from tasks.core.contracts import Rollout
    from tasks.engines.torch_engine import TorchEngine

    cfg = load_config(TINY, ["train.micro_batch_size=4", f"train.num_iterations={passes}", "train.lr=1e-2",
                             f"train.loss_type={loss_type}", "generate.num_generations=4",
                             "train.mask_truncated_completions=true", "train.weight_decay=0.1", *more])
    g = torch.Generator().manual_seed(1)

    def record(i: int, reward: float, truncated: bool = False) -> Rollout:
        n = 2 + i % 3
        return Rollout(group=i // 4, row=i // 4, prompt="p", prompt_ids=[3 + i // 4, 4, 5], completion="c",
                       completion_ids=torch.randint(6, 90, (n,), generator=g).tolist(),
                       logprobs=(-torch.rand(n, generator=g)).tolist(), truncated=truncated, reward=reward)

    class WithLengthTerm(Grpo):         # (a term that is not 0 at advantage 0)
        def loss(self, engine, b, fwd, totals, stats, first_pass):
            return super().loss(engine, b, fwd, totals, stats, first_pass) - 0.1 * (fwd.logp * b.mask).sum() / 64

    mixed = [record(i, r, truncated=(i == 6)) for i, r in zip(range(4, 8), (1.0, 0.0, 0.5, 1.0))]
    batch = [record(i, 0.7) for i in range(4)] + mixed + [record(i, 0.0) for i in range(8, 12)]
    flat = [record(i, 1.0) for i in range(4)]

    def run(records, skip: bool, kind=Grpo):
        torch.manual_seed(0)
        engine, learner = TorchEngine.open(cfg, None, None), kind(cfg, 1)
        engine.partial_backward = skip                 # (off: every row's backward runs, as on DeepSpeed)
        grads, step = [], engine.step

        def spy_step():
            grads.append([p.grad.clone() for p in engine.model.parameters()])
            return step()
        engine.step = spy_step
        rewards = torch.tensor([r.reward for r in records])
        batches = prepare_batches(records, learner.signal(rewards), engine.tokenizer.pad_token_id, cfg.train, "cpu")
        with_grad = []
        forward = update.completion_logprobs

        def spy(model, ids, *args, **kwargs):
            if torch.is_grad_enabled():
                with_grad.append(ids.shape[0])
            return forward(model, ids, *args, **kwargs)
        with monkeypatch.context() as mp:
            mp.setattr(update, "completion_logprobs", spy)
            stats = update.optimise(engine, batches, cfg, learner=learner)
        metrics = UpdateStats.metrics(stats, rewards, learner.signal(rewards), cfg.train, 1.0)
        return engine.model.state_dict(), metrics, with_grad, grads

    for records, learning_rows in ((batch, [3] * passes), (flat, [4] * passes)):
        skipped, every = run(records, True), run(records, False)
        assert skipped[2] == learning_rows and every[2] == [4] * (len(records) // 4) * passes
        for mine, theirs in zip(skipped[3], every[3], strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert torch.allclose(a, b, atol=1e-8, rtol=1e-5)
        for k, v in every[0].items():
            assert torch.allclose(skipped[0][k], v, atol=1e-6, rtol=1e-5), k
        for k, v in every[1].items():
            if k not in ("train/tokens_per_s", "train/seconds"):
                assert skipped[1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
        base = TorchEngine.open(cfg, None, None).model.state_dict()
        assert any(not torch.equal(base[k], v) for k, v in skipped[0].items())
    assert run(batch, True, WithLengthTerm)[2] == [4] * 3 * passes               # every row, with gradients


def test_a_group_of_equal_rewards_has_advantage_exactly_zero():
    """Equal rewards whose mean rounds off their value (eight 0.7s) still give exactly 0, not float noise divided by
    a std of float noise (TRL's formula gives ±6e-4 there)."""
    r = torch.tensor([0.7] * 8 + [1 / 3] * 7 + [math.nan] + [0.3, 0.7] * 4)
    for kind in ("group", "rloo"):
        adv = advantages(r, 8, kind)
        assert torch.equal(adv[:16], torch.zeros(16)), kind
        assert bool((adv[16:] != 0).all()), kind

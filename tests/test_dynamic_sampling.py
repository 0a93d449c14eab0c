"""Learning that holds (issue 40): dynamic sampling, overlong shaping, the curriculum, truncated-sampling logprobs.

What must hold: a group is constant by a test relative to the rewards' scale, never `std != 0` (rewards that
differ by 1e-9 are constant); the groups kept are the first useful ones, round by round, renumbered, and the
metrics say what was dropped and missing; a run with dynamic sampling is deterministic, and one stopped in the
middle of an iteration's rounds resumes to the uninterrupted run's weights; the curriculum defers prompts by its
stated rule and a resumed run (its stored state lost or not) picks the same prompts; the trainer's logprobs at
top_p < 1 are the kept tokens' renormalized, as a reference made from the full logits says; each new field's
mistakes are one line.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from tasks.algorithms import dynamic_sampling
from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.contracts import Rollout
from tasks.core.errors import UserError
from tasks.core.store import open_store
from tests.conftest import AT_LENGTH, ROOT, TINY


def _group(g: int, rewards: list[float | None], row: int | None = None) -> list[Rollout]:
    return [Rollout(group=g, row=g if row is None else row, prompt="p", prompt_ids=[1], completion="c",
                    completion_ids=[2], logprobs=[-1.0], truncated=False, reward=x) for x in rewards]


# ------------------------------------------------------------------------------------------ the constant test

def test_rewards_that_differ_by_float_noise_are_constant():
    """NeMo-RL's finding: `std != 0` lets 1e-9 through, and its advantages are that noise over ~1e-4."""
    noisy = [0.5, 0.5 + 1e-9, 0.5 - 1e-9, 0.5]
    assert torch.tensor(noisy, dtype=torch.float64).std() != 0                     # the unsafe test passes it
    assert dynamic_sampling.constant(noisy, scale=1.0, tolerance=1e-6)
    assert not dynamic_sampling.constant([0.0, 1.0, 1.0, 1.0], scale=1.0, tolerance=1e-6)
    assert not dynamic_sampling.constant([0.0, 1e-3], scale=1.0, tolerance=1e-6)
    # relative to the scale: rewards in the thousands differ by float noise of their own size
    assert dynamic_sampling.constant([1000.0, 1000.0 + 1e-4], scale=1000.0, tolerance=1e-6)
    assert not dynamic_sampling.constant([1000.0, 1001.0], scale=1000.0, tolerance=1e-6)
    # missing rewards are left out; fewer than two present: no baseline, constant
    assert dynamic_sampling.constant([None, 1.0, None], scale=1.0, tolerance=1e-6)
    assert not dynamic_sampling.constant([None, 1.0, 0.0], scale=1.0, tolerance=1e-6)
    records = _group(0, [1.0, 1.0 + 1e-9]) + _group(1, [0.0, 1.0]) + _group(2, [3000.0, 3000.0 + 1e-4])
    assert dynamic_sampling.scale_of(records) == 3000.0 + 1e-4
    assert dynamic_sampling.constant_groups(records, 1e-6) == {0: True, 1: False, 2: True}


def test_the_first_useful_groups_are_kept_round_by_round_and_renumbered():
    r0 = _group(0, [1.0, 1.0]) + _group(1, [0.0, 1.0]) + _group(2, [0.0, 0.0])
    r1 = _group(0, [0.2, 0.4], row=10) + _group(1, [1.0, 1.0], row=11) + _group(2, [0.0, 0.5], row=12)
    kept, metrics = dynamic_sampling.select([r0, r1], wanted=2, tolerance=1e-6)
    assert [(r.group, r.row, r.reward) for r in kept] == [(0, 1, 0.0), (0, 1, 1.0), (1, 10, 0.2), (1, 10, 0.4)]
    assert metrics == {"dynamic/rounds": 2.0, "dynamic/groups_sampled": 6.0, "dynamic/groups_dropped": 3.0,
                       "dynamic/groups_kept": 2.0, "dynamic/extra_completions": 6.0, "dynamic/short": 0.0}
    assert dynamic_sampling.enough([r0, r1], 3, 1e-6) and not dynamic_sampling.enough([r0], 2, 1e-6)
    # short: what there is; none at all: the first round as it was (an update without signal), said by the metrics
    kept, metrics = dynamic_sampling.select([r0], wanted=4, tolerance=1e-6)
    assert [r.row for r in kept] == [1, 1] and metrics["dynamic/short"] == 3.0
    flat = _group(0, [1.0, 1.0]) + _group(1, [0.0, 0.0])
    kept, metrics = dynamic_sampling.select([flat, flat], wanted=2, tolerance=1e-6)
    assert kept == flat and metrics["dynamic/groups_kept"] == 0.0 and metrics["dynamic/short"] == 2.0


# ------------------------------------------------------------------------------------------ overlong shaping

def test_an_agents_split_episode_is_punished_once_by_its_whole_length():
    """An episode split into samples (Rollout.part > 0) is as long as all of it after its first prompt: each of its
    samples carries that one punishment (the advantage reads its first), and the metrics count it once."""
    from tasks.scoring.shaping import add_overlong

    cfg = load_config(ROOT / "configs" / "agent.yaml", ["reward.overlong={buffer: 16, penalty: 1.0}",
                                                        "env.max_tokens=64"])

    def sample(part: int, prompt: int, n: int) -> Rollout:
        return Rollout(group=0, row=0, prompt="p", prompt_ids=[1] * prompt, completion="c", completion_ids=[2] * n,
                       logprobs=[-1.0] * n, truncated=False, reward=1.0, part=part)

    # 10 tokens, then a sample whose prompt holds the first 10 and 4 more and which runs to 64 after the first prompt
    records = [sample(0, 5, 10), sample(1, 19, 50), sample(0, 5, 10)]
    metrics = add_overlong(cfg, records)
    assert [r.rewards["overlong"] for r in records] == [-1.0, -1.0, 0.0]
    assert [r.reward for r in records] == [0.0, 0.0, 1.0]
    assert metrics == {"reward/overlong/mean": -0.5, "reward/overlong/share": 0.5}
    assert dynamic_sampling.constant_groups(records, 1e-6) == {0: False}


def test_a_function_named_as_the_shaping_is_refused():
    from tasks.scoring.functions import load_functions

    cfg = load_config(TINY, ['reward.functions=[{fn: "tasks.scoring.shaping:overlong", weight: 1.0}]'])
    with pytest.raises(UserError, match=r"^reward.functions: 'overlong' names reward.overlong's shaping"):
        load_functions(cfg)


def test_the_group_shares_count_every_rounds_groups_and_judge_passing_without_the_shaping():
    """Each round numbers its groups from 0: two rounds' group 0 are two groups. A group that passed its task but
    was punished for length is easy (the shaping is not the task's verdict)."""
    from tasks.reward import _group_shares

    cfg = load_config(TINY, ["generate.dynamic_sampling={max_rounds: 2}"])
    r0, r1 = _group(0, [1.0, 1.0]), _group(0, [0.0, 0.0], row=7)
    assert _group_shares(cfg, [r0, r1]) == {"reward/groups_useful": 0.0, "reward/groups_easy": 0.5,
                                            "reward/groups_hard": 0.5}
    for r in r0:
        r.rewards["overlong"], r.reward = -1.0, 0.0
    assert _group_shares(cfg, [r0])["reward/groups_easy"] == 1.0


def test_extra_rounds_are_full_on_a_small_data_set_and_the_same_however_many_are_asked():
    """Round r > 0 skips round 0's rows; with 7 of 8 rows taken the stream still fills each round, and round r's
    rows are the same whether 2 or 5 rounds are asked for (the stage mode asks round by round, streaming all)."""
    from tasks.core.curriculum import rounds

    cfg = load_config(TINY, ["generate.prompts_per_iteration=7", "generate.dynamic_sampling={max_rounds: 5}"])
    for it in (1, 2, 3):
        every = rounds(cfg, None, it, 5, 8)[0]
        assert [len(r) for r in every] == [7] * 5
        for n in (1, 2, 3, 4):
            assert rounds(cfg, None, it, n, 8)[0] == every[:n]
        assert every[1].count(next(iter(set(range(8)) - set(every[0])))) >= 1    # the one row round 0 left


def test_the_overlong_punishment_grows_over_the_buffer():
    """DAPO eq. 13: 0 before the buffer, then linearly to -penalty at the limit."""
    from tasks.scoring.shaping import overlong

    got = [overlong(n, limit=20, buffer=4, penalty=1.0) for n in (10, 16, 17, 18, 20)]
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong(20, limit=20, buffer=4, penalty=0.5) == -0.5


# ------------------------------------------------------------------------------------------ truncated sampling

def test_the_trainers_logprobs_at_top_p_are_renormalized_over_the_kept_tokens():
    """A reference from the full logits: sort, keep the smallest set with top_p of the mass (and top_k first),
    renormalize; the sampled token is always kept. The ratio against the full distribution is the kept mass."""
    from tasks.algorithms.logprobs import Distribution, truncated_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 50, generator=g) * 3
    targets = torch.randint(0, 50, (3, 5), generator=g)
    for dist in (Distribution(0.7, 0, 0.8), Distribution(1.0, 10, 1.0), Distribution(0.7, 8, 0.9)):
        scaled = logits / dist.temperature
        got = truncated_logprobs(scaled, targets, dist)
        for b in range(3):
            for t in range(5):
                row = scaled[b, t]
                order = torch.argsort(row, descending=True)
                keep = order[:dist.top_k] if dist.top_k else order
                probs = torch.softmax(row[keep], -1)
                # the fewest most likely tokens whose mass reaches top_p (transformers' and vLLM's rule)
                n = int((torch.cumsum(probs, 0) < dist.top_p).sum()) + 1 if dist.top_p < 1 else len(keep)
                support = set(keep[:n].tolist()) | {int(targets[b, t])}
                idx = torch.tensor(sorted(support))
                want = row[targets[b, t]] - torch.logsumexp(row[idx], 0)
                assert got[b, t].item() == pytest.approx(want.item(), abs=1e-5)
    # gradients flow to the kept logits only
    scaled = (logits / 0.7).requires_grad_(True)
    truncated_logprobs(scaled, targets, Distribution(0.7, 0, 0.8)).sum().backward()
    assert (scaled.grad != 0).sum() < scaled.numel() / 2


def test_the_hf_sampler_and_the_trainer_agree_at_top_p(tmp_path):
    """The behaviour logprobs (hf, the trainer's own warpers) against the trainer's on the same tokens: the ratio
    is 1 within float noise at top_p 0.8 (against the full distribution it would be the kept mass)."""
    from tasks.algorithms.batching import pad_batch
    from tasks.algorithms.logprobs import Distribution, completion_logprobs
    from tasks.core.contracts import SamplingParams
    from tasks.core.models import base_path, load_policy, load_tokenizer
    from tasks.engines.hf import hf_generate

    cfg = load_config(TINY)
    path = base_path(cfg)
    model, tok = load_policy(cfg, path, torch.device("cpu")).eval(), load_tokenizer(path)
    prompts = [tok(p)["input_ids"] for p in ("a=", "b=", "q=")]
    samples = hf_generate(model, tok, prompts, SamplingParams(n=4, max_new_tokens=6, temperature=0.7, top_p=0.8,
                                                             seed=3, top_k=12), batch_size=3)
    ids, attn, pos, mask = pad_batch([prompts[s.prompt] for s in samples], [s.completion_ids for s in samples],
                                     tok.pad_token_id)
    with torch.no_grad():
        cut, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], Distribution(0.7, 12, 0.8))
        full, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7)
    behaviour = torch.tensor([s.logprobs + [0.0] * (mask.shape[1] - len(s.logprobs)) for s in samples])
    ratio = torch.exp(cut - behaviour)[mask.bool()]
    assert ratio.mean().item() == pytest.approx(1.0, abs=1e-3) and (ratio - 1).abs().max() < 1e-3
    kept_mass = torch.exp(full - behaviour)[mask.bool()]
    assert kept_mass.mean() < 0.99                        # what the full distribution's ratio would have been


def test_what_a_models_generation_config_sets_does_not_reach_the_sampler(tmp_path):
    """A model folder whose generation_config.json sets logits processors (Qwen2.5-Instruct ships a
    repetition_penalty): the hf engine samples by rlflow's processor alone, so its behaviour logprobs are the
    trainer's (transformers' generate fills what a call leaves unset from that file)."""
    from tasks.algorithms.batching import pad_batch
    from tasks.algorithms.logprobs import completion_logprobs
    from tasks.core import builtin_models
    from tasks.core.contracts import SamplingParams
    from tasks.core.models import load_policy, load_tokenizer
    from tasks.engines.hf import HFEngine

    folder = tmp_path / "model"
    shutil.copytree(builtin_models.resolve("builtin:tiny-lm"), folder)
    gen = folder / "generation_config.json"
    shipped = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**shipped, "repetition_penalty": 3.0, "no_repeat_ngram_size": 1}))
    cfg = load_config(TINY, [f"model.name_or_path={folder}"])
    tok = load_tokenizer(str(folder))
    prompts = [tok(p)["input_ids"] for p in ("a=", "b=", "q=")]
    with HFEngine(cfg).session("p", str(folder), tok) as session:
        samples = session.sample(prompts, SamplingParams(n=4, max_new_tokens=8, temperature=1.0, top_p=1.0,
                                                                seed=3)).samples
    model = load_policy(cfg, str(folder), torch.device("cpu")).eval()
    ids, attn, pos, mask = pad_batch([prompts[s.prompt] for s in samples], [s.completion_ids for s in samples],
                                     tok.pad_token_id)
    with torch.no_grad():
        mine, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 1.0)
    behaviour = torch.tensor([s.logprobs + [0.0] * (mask.shape[1] - len(s.logprobs)) for s in samples])
    assert ((mine - behaviour).abs() * mask).max() < 1e-4
    assert any(len(set(s.completion_ids)) < len(s.completion_ids) for s in samples)   # repeats: no penalty ran


# ------------------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("override, line", [
    ("generate.dynamic_sampling={max_rounds: 0}",
     "config: generate.dynamic_sampling.max_rounds: input should be greater than or equal to 1, got 0"),
    ("generate.num_generations=1",
     "config: generate.num_generations: input should be greater than or equal to 2, got 1"),
    ("reward.overlong={buffer: 24}",
     "config: reward.overlong.buffer: 24 tokens is not shorter than the completion limit "
     "(generate.max_completion_length 24): every completion would be punished; expected a buffer below 24"),
    ("data.curriculum={defer: 8, max_defer: 4}",
     "config: data.curriculum: max_defer (4) is below defer (8): the deferral could never be as long as defer says"),
    ("generate.dynamic_sampling={tolerance: 0}",
     "config: generate.dynamic_sampling.tolerance: input should be greater than 0, got 0"),
    ("data.curriculum={defer: 1}",      # (with run.max_staleness 1, below: a deferral that never takes effect)
     "config: data.curriculum.defer: 1 iteration is not longer than run.max_staleness (1): iteration N's groups "
     "are known when iteration N+1+1 is picked, so a deferral of 1 iterations or fewer never takes effect; "
     "expected defer above 1"),
])
def test_each_new_fields_mistake_is_one_line(override, line):
    with pytest.raises(UserError) as e:
        load_config(TINY, ["generate.max_completion_length=24", "run.max_staleness=1", "run.iterations=10", override])
    assert str(e.value) == line


def test_dynamic_sampling_where_constant_groups_still_teach_is_warned_of(capsys):
    """Dropping a group whose rewards are all equal drops nothing where its advantages are 0 (relative to the
    group); under a value model or REINFORCE++'s batch baseline it drops signal: said once as the config is read."""
    ds = "generate.dynamic_sampling={max_rounds: 2}"
    for quiet in ([], ["train.learner={advantage: rloo}"], ["train.learner={advantage: reinforce_pp_baseline}"]):
        capsys.readouterr()
        load_config(TINY, [ds, *quiet])
        assert "warning" not in capsys.readouterr().err
    for loud, how in ((["train.algorithm=ppo"], "train.algorithm ppo"),
                      (["train.learner={advantage: reinforce_pp}"], "train.learner.advantage reinforce_pp")):
        load_config(TINY, [ds, *loud])
        err = capsys.readouterr().err
        assert err.count("warning: generate.dynamic_sampling drops the groups") == 1 and f"under {how}" in err


def test_a_curriculum_needs_prompts_with_stable_ids():
    from tasks.core.curriculum import check

    check(load_config(TINY, ["data.curriculum={defer: 2}"]))                     # a local file: fine
    with pytest.raises(UserError, match=r"^data.curriculum: needs prompts with stable ids .*openai/gsm8k is a hub "
                                        r"dataset"):
        check(load_config(TINY, ["data.curriculum={defer: 2}", "data.path=openai/gsm8k"]))


def test_a_round_without_dynamic_sampling_is_refused(tmp_path):
    from tasks.generate import generate
    from tasks.reward import reward

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store"])
    with pytest.raises(UserError, match=r"^--round 1: rounds are dynamic sampling's"):
        generate(cfg, 1, round=1)
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "generate.dynamic_sampling={max_rounds: 2}"])
    with pytest.raises(UserError, match=r"^--round 2: expected 0 to 1"):
        reward(cfg, 1, round=2)
    assert not (tmp_path / "store").exists()


# ------------------------------------------------------------------------------------------ whole iterations

DS = ["generate.dynamic_sampling={max_rounds: 3, prompts_per_round: 4}", "generate.prompts_per_iteration=4",
      "generate.num_generations=4", "train.lr=1e-2", "train.mode=process", "eval.every=0",
      "tracking.dashboard_every=0", "launcher.retry_backoff_seconds=0"]


def _iterations(cfg, first: int, last: int, stop_in_round: int | None = None) -> None:
    """The loop the flow runs (flows/schedule.py: rounds until reward says complete), with the stage functions;
    `stop_in_round`: stop after that round's generate of the last iteration (a kill between two stages)."""
    from tasks.generate import generate
    from tasks.publish import publish
    from tasks.reward import reward
    from tasks.train import train

    for it in range(first, last + 1):
        policy, r, n = layout.behaviour_policy(cfg.run.name, it, cfg.run.max_staleness), {"complete": False}, 0
        while not r["complete"]:
            generate(cfg, it, policy, round=n)
            if it == last and n == stop_in_round:
                return
            r = reward(cfg, it, round=n)
            n += 1
        train(cfg, it)
        publish(cfg, it)


def _weights(cfg) -> list[str]:
    store = open_store(cfg)
    return [store.manifest(layout.policy(cfg.run.name, it))["files"]["model.safetensors"]["sha256"]
            for it in range(1, cfg.run.iterations + 1)]


@pytest.mark.slow
def test_dynamic_sampling_is_deterministic_and_resumes_inside_the_rounds(tmp_path, prefect_api, monkeypatch):
    """The same seed, the same batch; a run stopped after round 1's generate of iteration 2 and resumed by the
    flow ends with the uninterrupted run's weights; the rounds and the kept groups are in the store."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    ref = load_config(TINY, [*DS, "run.name=ref", "run.iterations=3", f"store.uri={tmp_path}/ref"])
    _iterations(ref, 1, 3)
    again = load_config(TINY, [*DS, "run.name=ref", "run.iterations=3", f"store.uri={tmp_path}/again"])
    _iterations(again, 1, 3)
    assert _weights(again) == _weights(ref)
    store = open_store(ref)
    rounds = [int(store.manifest(layout.rewards("ref", it))["meta"]["metrics"]["dynamic/rounds"]) for it in (1, 2, 3)]
    assert max(rounds) >= 2, rounds                  # the tiny model's rewards leave constant groups to refill
    for it, n in zip((1, 2, 3), rounds):
        assert all(store.manifest(layout.scored("ref", it, r)) for r in range(n))
        kept = store.manifest(layout.rewards("ref", it))["meta"]["metrics"]
        assert kept["dynamic/groups_kept"] + kept["dynamic/short"] == 4

    overrides = [*DS, "run.name=ref", "run.iterations=3", f"store.uri={tmp_path}/resumed",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    stopped = load_config(TINY, overrides)
    second = next(it for it, n in zip((1, 2, 3), rounds) if n >= 2)
    _iterations(stopped, 1, second, stop_in_round=1)
    assert open_store(stopped).manifest(layout.rewards("ref", second)) is None
    train_flow(str(TINY), overrides)
    assert _weights(stopped) == _weights(ref)


def test_the_curriculum_defers_by_its_rule():
    """A constant group defers its row for `defer` iterations after its own, doubling with each one in a row (at
    most max_defer); a useful one ends the streak; the stream skips a deferred row and serves it first when due."""
    from tasks.core.curriculum import Sampler

    s = Sampler()
    s.fold(1, [(5, True), (6, False), (5, True)], defer=2, max_defer=5)      # row 5 twice in one iteration: once
    assert s.rows == {"5": [1, 4]} and s.deferred(2) == s.deferred(3) == {5} and s.deferred(4) == set()
    s.fold(3, [(5, True)], defer=2, max_defer=5)
    s.fold(7, [(5, True)], defer=2, max_defer=5)
    assert s.rows["5"] == [3, 7 + 5 + 1]                                      # 2, 4, then capped at 5
    assert s.deferred(12) == {5} and s.deferred(13) == set()                  # iterations 8 .. 12: five
    s.fold(8, [(5, False)], defer=2, max_defer=5)
    assert s.rows == {}

    s = Sampler()
    s.fold(1, [(r, True) for r in range(3)], defer=1, max_defer=8)            # rows 0, 1, 2 deferred at 2
    first = s.pick(2, 4, n_rows=10, seed=0, shuffle=False)
    assert first == [3, 4, 5, 6] and s.waiting == [[0, 3], [1, 3], [2, 3]]
    assert s.pick(3, 4, n_rows=10, seed=0, shuffle=False) == [0, 1, 2, 7]     # served first when due
    assert s.served_late == 3 and s.waiting == []


@pytest.mark.slow
def test_a_resumed_curriculum_takes_the_same_prompts(tmp_path):
    """The sampler's state comes from the stored rewards alone: a run resumed after iteration 3 (its stored
    states deleted, or kept) picks what the uninterrupted run picked, and trains to the same weights."""
    base = ["data.curriculum={defer: 2}", "generate.prompts_per_iteration=3", "generate.num_generations=4",
            "train.lr=1e-2", "train.mode=process", "eval.every=0", "run.iterations=6", "run.max_staleness=1"]
    ref = load_config(TINY, [*base, "run.name=cur", f"store.uri={tmp_path}/ref"])
    _iterations(ref, 1, 6)
    resumed = load_config(TINY, [*base, "run.name=cur", f"store.uri={tmp_path}/resumed"])
    _iterations(resumed, 1, 3)
    store = open_store(resumed)
    for k in range(1, 3):
        store.delete_folder(layout.curriculum("cur", k))
    _iterations(resumed, 4, 6)

    def rows(cfg):
        s = open_store(cfg)
        return [s.manifest(layout.rollouts("cur", it))["meta"]["rows"] for it in range(1, 7)]

    assert rows(resumed) == rows(ref)
    assert _weights(resumed) == _weights(ref)
    deferred = [open_store(ref).manifest(layout.rollouts("cur", it))["meta"]["metrics"]["curriculum/deferred"]
                for it in range(1, 7)]
    assert any(d > 0 for d in deferred), deferred
    shares = open_store(ref).manifest(layout.rewards("cur", 3))["meta"]["metrics"]
    assert math.isclose(shares["reward/groups_easy"] + shares["reward/groups_hard"] + shares["reward/groups_useful"], 1)


def test_the_reward_stage_adds_the_overlong_punishment_apart_and_logs_weight_zero_functions(tmp_path):
    """reward.overlong: each scored completion gets rewards["overlong"], added to its reward and logged as
    reward/overlong/*, while reward/mean stays the task's; a weight-0 function is scored and logged, never paid;
    every group's verdict is in the manifest (what the curriculum reads), with the easy/hard/useful shares."""
    from tasks.core import rollout
    from tasks.generate import generate
    from tasks.reward import reward

    fns = ('[{fn: "tasks.rewards.demo:successor_reward", weight: 1.0}, '
           '{fn: "tasks.rewards.demo:stops_reward", weight: 0.0}]')
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=ol", "reward.overlong={buffer: 2, penalty: 0.5}",
                             f"reward.functions={fns}", "generate.prompts_per_iteration=4",
                             "generate.num_generations=4"])
    generate(cfg, 1, layout.BASE)
    out = reward(cfg, 1)
    records = rollout.load(open_store(cfg), layout.rewards("ol", 1))
    limit = cfg.generate.max_completion_length
    for r in records:
        want = -0.5 * min(max(len(r.completion_ids) - (limit - 2), 0), 2) / 2
        assert r.rewards["overlong"] == want
        assert r.reward == pytest.approx(r.rewards["successor_reward"] + want)      # stops_reward: weight 0
        assert r.rewards["stops_reward"] in (0.0, 1.0)
    m = out["metrics"]
    assert m["reward/mean"] == pytest.approx(sum(r.rewards["successor_reward"] for r in records) / len(records))
    assert m["reward/overlong/mean"] == pytest.approx(sum(r.rewards["overlong"] for r in records) / len(records))
    assert 0 < m["reward/overlong/share"] <= 1 and "reward/stops_reward/mean" in m
    assert m["reward/groups_useful"] + m["reward/groups_easy"] + m["reward/groups_hard"] == pytest.approx(1.0)
    groups = open_store(cfg).manifest(layout.rewards("ol", 1))["meta"]["groups"]
    assert [g[0] for g in groups] == [records[4 * i].row for i in range(4)] and all(isinstance(g[1], bool)
                                                                                   for g in groups)


def test_evaluation_reports_the_formats_share_and_the_accuracy_among_formatted_answers(tmp_path):
    from tasks.evaluate import evaluate

    fns = ('[{fn: "tasks.rewards.demo:successor_reward", weight: 1.0}, '
           '{fn: "tasks.rewards.demo:stops_reward", weight: 0.0}]')
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=ev", f"reward.functions={fns}",
                             "eval.every=1", "eval.greedy=true", "eval.pass_reward=successor_reward",
                             "eval.format_reward=stops_reward", "eval.pass_threshold=0.3"])
    metrics = evaluate(cfg, 0)["metrics"]
    from tasks.core import rollout

    greedy = rollout.read(open_store(cfg).local(layout.evaluation("ev", 0)) / "greedy")
    formatted = [r for r in greedy if r.rewards["stops_reward"] == 1.0]
    assert metrics["eval/greedy_format_share"] == pytest.approx(len(formatted) / len(greedy))
    assert metrics.get("eval/greedy_pass_at_1_formatted") == (pytest.approx(
        sum(r.rewards["successor_reward"] >= 0.3 for r in formatted) / len(formatted)) if formatted else None)
    from tasks.evaluate import format_metrics

    unformatted = [Rollout(**{**vars(r), "rewards": {**r.rewards, "stops_reward": 0.0}}) for r in greedy]
    assert format_metrics(cfg, unformatted) == {"eval/greedy_format_share": 0.0}     # no accuracy among none
    bad = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=ev2", "eval.format_reward=nothing"])
    with pytest.raises(UserError, match=r"^eval.format_reward: 'nothing' is not one of the reward functions"):
        evaluate(bad, 0)


LETTERS = ROOT / "configs" / "letters.yaml"
AGENT = ROOT / "configs" / "agent.yaml"


@pytest.mark.slow
@pytest.mark.parametrize("config", [LETTERS, AGENT], ids=["episodes", "agents"])
def test_dynamic_sampling_with_episodes_agents_and_overlap_matches_the_stages(config, tmp_path, prefect_api,
                                                                              monkeypatch):
    """Multi-turn episodes (an environment) and agents (their calls through the endpoint), with run.max_staleness 1:
    the flow (round 0 in the look-ahead lane, later rounds when the iteration is taken) trains to the weights the
    stage functions give one after another."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    base = ["generate.dynamic_sampling={max_rounds: 3}", "generate.prompts_per_iteration=4",
            "generate.num_generations=4", "run.iterations=3", "run.max_staleness=1", "train.mode=process",
            "tracking.dashboard_every=0", "launcher.retry_backoff_seconds=0", "run.name=ep"]
    ref = load_config(config, [*base, f"store.uri={tmp_path}/ref"])
    _iterations(ref, 1, 3)
    overrides = [*base, f"store.uri={tmp_path}/flow", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    train_flow(str(config), overrides)
    assert _weights(load_config(config, overrides)) == _weights(ref)
    store = open_store(ref)
    rounds = [store.manifest(layout.rewards("ep", it))["meta"]["metrics"]["dynamic/rounds"] for it in (1, 2, 3)]
    assert max(rounds) >= 2, rounds


def test_a_corrupt_batch_of_rounds_is_made_again_by_its_last_round(tmp_path):
    """iter-N/rewards under dynamic sampling is written by the reward stage of the round that completed it, which
    reads every round: Repair makes it again from there (round 0 alone found too few groups and wrote nothing)."""
    from types import SimpleNamespace

    from flows.repair import Repair
    from flows.training import STAGE_FUNCTIONS
    from tasks.core import rollout
    from tasks.core.store import CorruptArtifact
    from tasks.generate import generate
    from tasks.reward import reward

    cfg = load_config(TINY, [*DS, f"store.uri={tmp_path}/store", "run.name=rep"])
    for seed in range(8):                    # (a seed whose first iteration needs more than one round)
        cfg = load_config(TINY, [*DS, f"store.uri={tmp_path}/store-{seed}", "run.name=rep", f"run.seed={seed}"])
        r, n = {"complete": False}, 0
        while not r["complete"]:
            generate(cfg, 1, layout.BASE, round=n)
            r, n = reward(cfg, 1, round=n), n + 1
        if n > 1:
            break
    assert n > 1
    store, key = open_store(cfg), layout.rewards("rep", 1)
    made = store.manifest(key)["files"][rollout.FILE]["sha256"]
    said = []
    repair = Repair(lambda name, it, ctx, *a, **k: STAGE_FUNCTIONS[name](cfg, it, *a, **k),
                    SimpleNamespace(cfg=cfg, store=store), SimpleNamespace(warning=said.append))
    repair._remake(CorruptArtifact(key, "test: changed"), set())
    assert store.manifest(key)["files"][rollout.FILE]["sha256"] == made
    assert said and said[0].endswith(f"making it again (reward of iteration 1 round {n - 1})")


def test_an_agents_episode_counts_once_in_the_constant_test():
    """An agent's episode split step-wise (Rollout.part > 0 after its first sample) shares its episode's reward:
    the group is judged on its episodes, not on their samples."""
    first = _group(0, [1.0, 0.0])
    parts = [Rollout(group=0, row=0, prompt="p", prompt_ids=[1], completion="c", completion_ids=[2], logprobs=[-1.0],
                     truncated=False, reward=x, part=1) for x in (1.0, 0.0, 0.0)]
    assert dynamic_sampling.constant_groups(first + parts, 1e-6) == {0: False}
    same = _group(0, [1.0, 1.0]) + [Rollout(**{**vars(parts[0]), "reward": 0.0})]
    assert dynamic_sampling.constant_groups(same, 1e-6) == {0: True}


def test_an_update_on_uneven_groups_is_the_same_twice(request):
    """Groups that straddle the rows two threads split (12 rows of 4-row groups, dynamic sampling's kept batches):
    the shared prompt's gradient sums its rows in a fixed order, so the same update twice is the same to the bit
    (a replay on a CPU must be exact). With the cache's own gather it was not."""
    from tasks.algorithms.batching import pad_batch
    from tasks.algorithms.logprobs import completion_logprobs
    from tasks.core.models import base_path, load_policy, load_tokenizer

    threads = torch.get_num_threads()
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    torch.set_num_threads(2)
    cfg = load_config(TINY)
    path = base_path(cfg)
    model, tok = load_policy(cfg, path, torch.device("cpu"), trainable=True), load_tokenizer(path)
    # prompts long enough that the gathered keys and values pass torch's grain for splitting work over threads
    prompts = [tok(p * 60)["input_ids"] for p in ("a=", "bb=", "ccc=") for _ in range(4)]
    completions = [[5 + i % 7, 9, 11 + i % 3][: 1 + i % 3] for i in range(12)]
    ids, attn, pos, mask = pad_batch(prompts, completions, tok.pad_token_id)
    grads = []
    for _ in range(6):
        model.zero_grad()
        logp, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 0.7)
        (logp * mask).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert all(torch.equal(grads[0], g) for g in grads[1:])


def test_a_run_whose_groups_stay_constant_says_so_once():
    from flows.training import ConsoleWarnings

    cfg = load_config(TINY, ["generate.dynamic_sampling={max_rounds: 2}"])
    said = []
    watch = ConsoleWarnings(cfg, said.append, type("Log", (), {"warning": lambda *a: None})())
    for it in range(1, 5):
        watch.iteration(it, {"dynamic/groups_kept": 0.0 if it != 2 else 3.0}, {})
    assert said == ["warning: iteration 1: every group was constant through generate.dynamic_sampling.max_rounds "
                    "(2 rounds): trained without a learning signal (dynamic/short counts such iterations' missing "
                    "groups); said once"]


@AT_LENGTH
@pytest.mark.slow
@pytest.mark.drill
def test_a_run_killed_between_rounds_resumes_to_the_uninterrupted_weights(tmp_path, prefect_api):
    """SIGKILL of the whole process group as soon as a later round of an iteration exists (a generate of round 1
    committed, its reward not), then the same command: the uninterrupted run's weights."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import run_cli

    args = [a for o in [*DS, "run.name=kill", "run.iterations=3", "tracking.dashboard_every=0"] for a in ("-o", o)]
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir(), killed.mkdir()
    assert run_cli(["run", str(TINY), *args], clean, prefect_api).returncode == 0
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(TINY), *args], cwd=killed,
                            env={**os.environ, "PREFECT_API_URL": prefect_api}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    store_dir = killed / "rlflow-store" / "kill"
    deadline = time.time() + 300
    while not any((store_dir / f"iter-{it:06d}" / "rollouts-r01" / "MANIFEST.json").exists() for it in (2, 3)):
        assert proc.poll() is None and time.time() < deadline, "the run ended (or stalled) before a later round"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert run_cli(["run", str(TINY), *args], killed, prefect_api).returncode == 0
    for it in (1, 2, 3):
        key = f"kill/policy/v{it:06d}/MANIFEST.json"
        got = (killed / "rlflow-store" / key).read_text()
        want = (clean / "rlflow-store" / key).read_text()
        import json

        assert json.loads(got)["files"] == json.loads(want)["files"]


LOGS_BATCH = '''
def logs_batch(completions, log_metric, **kw):
    log_metric("batch", float(len(completions)))
    return [1.0] * len(completions)                 # every group constant: each round runs
'''


def test_the_rounds_log_metric_values_reach_the_iterations_metrics(tmp_path, monkeypatch):
    """Under dynamic sampling the iteration's metrics kept only the rounds' seconds and error counts: what the
    functions logged with log_metric was lost. It is the mean over every completion scored, rounds weighted."""
    from tasks.core import rollout
    from tasks.generate import generate
    from tasks.reward import reward

    (tmp_path / "logs_batch.py").write_text(LOGS_BATCH)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=lm", "generate.prompts_per_iteration=4",
                             "reward.functions=[{fn: 'logs_batch:logs_batch'}]", "generate.num_generations=4",
                             "generate.dynamic_sampling={max_rounds: 2, prompts_per_round: 2}"])
    generate(cfg, 1, layout.BASE)
    first = reward(cfg, 1)
    assert not first["complete"] and first["metrics"]["reward/batch"] == 16.0
    generate(cfg, 1, layout.BASE, round=1)
    out = reward(cfg, 1, round=1)
    sizes = [len(rollout.load(open_store(cfg), layout.scored("lm", 1, r))) for r in (0, 1)]
    assert out["complete"] and sizes == [16, 8]
    assert out["metrics"]["reward/batch"] == pytest.approx((16 * 16 + 8 * 8) / 24)      # (not 12: by completions)
    assert out["metrics"]["reward/logs_batch/errors"] == 0.0 and out["metrics"]["dynamic/rounds"] == 2.0


def test_the_log_metric_values_of_a_streamed_iteration_with_dynamic_sampling_reach_its_metrics(tmp_path, monkeypatch):
    """generate.streaming with dynamic sampling: the groups scored as they completed logged with log_metric, and
    the iteration's metrics lost it. It is their mean (one call per group of 4 completions)."""
    from tasks.engines.streaming import Stream
    from tasks.generate import generate
    from tasks.reward import reward
    from tests.test_streaming import _overrides

    (tmp_path / "logs_batch.py").write_text(LOGS_BATCH)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(TINY, _overrides(tmp_path, "slm", "generate.dynamic_sampling={max_rounds: 2, prompts_per_round: "
                                       "2}", "generate.max_completion_length=8", "generate.streaming.on_update="
                                       "interrupt", "reward.functions=[{fn: 'logs_batch:logs_batch'}]"))
    try:
        generate(cfg, 1, layout.BASE)
        out = reward(cfg, 1)
    finally:
        Stream.stop_run("slm")
    assert out["complete"] and "reward/streamed_seconds" in out["metrics"]      # (scored as they completed)
    assert out["metrics"]["reward/batch"] == 4.0


def test_an_iteration_scored_in_no_round_is_said_once_of_its_rounds(tmp_path, capfd):
    """Without reward.strict, an iteration whose function scored nothing in any round (its previous one scored)
    trains on nothing and goes on: said once, of the rounds' batch (was: once per round, 3 lines here, and said
    of a round even where a later round scored and the iteration trained)."""
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=silent", "run.iterations=2", "eval.every=0",
                             "generate.prompts_per_iteration=4", "generate.num_generations=4",
                             "generate.dynamic_sampling={max_rounds: 3}",
                             'reward.functions=[{"fn": "tests.reward_examples:nothing_in_iteration_2"}]'])
    _iterations(cfg, 1, 2)
    said = capfd.readouterr().err
    assert said.count("iteration 2 takes no training step") == 1, said
    assert said.count("no completion of iteration 2 was scored") == 1, said


def test_an_overlong_buffer_no_limit_leaves_room_for_says_what_to_change():
    """A completion limit of 1 token: no buffer (>= 1) is below it. Was: "expected a buffer below 1", which no
    value meets."""
    with pytest.raises(UserError, match=r"expected a buffer below 1 \(none is: raise generate.max_completion_length, "
                                        r"or drop reward.overlong\)$"):
        load_config(TINY, ["generate.max_completion_length=1", "reward.overlong={buffer: 1}"])

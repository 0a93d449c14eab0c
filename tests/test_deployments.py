"""The repository's prefect.yaml against a real Prefect server started here: `prefect deploy --all`, a process
worker, `prefect deployment run` with parameter overrides, the flow run completes, named after the rlflow run,
and its dashboard artifact (the report) read back through the Prefect client. The schedule and the parameter
schema are checked too, and which flow run names are kept."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
PREFECT = [sys.executable, "-m", "prefect"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`prefect server start` on 127.0.0.1 with its own home (database); yields the env that points at it."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError((home / "server.log").read_text()[-3000:]) from None
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("prefect server did not start: " + (home / "server.log").read_text()[-3000:])
    yield env
    proc.terminate()
    proc.wait(timeout=30)


def _prefect(args, env, cwd, timeout=180):
    out = subprocess.run([*PREFECT, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return out


@pytest.fixture(scope="module")
def project(server, tmp_path_factory):
    """The deployable part of the repository (prefect.yaml, flows/, configs/, sky/), deployed from a copy so
    the flow runs write their files there, not into the checkout."""
    root = tmp_path_factory.mktemp("project")
    for name in ("prefect.yaml",):
        shutil.copy(ROOT / name, root / name)
    for name in ("flows", "configs", "sky"):
        shutil.copytree(ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = _prefect(["work-pool", "create", "rlflow", "--type", "process"], server, root)
    assert out.returncode == 0, out.stdout + out.stderr
    out = _prefect(["--no-prompt", "deploy", "--all"], server, root)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return root


@contextlib.contextmanager
def _client(env):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            yield client


def test_deploy_registers_nightly_and_manual_with_schedule_and_schema(server, project):
    with _client(server) as client:
        nightly = client.read_deployment_by_name("rlflow-train/nightly")
        manual = client.read_deployment_by_name("rlflow-train/manual")
        assert nightly.work_pool_name == manual.work_pool_name == "rlflow"
        assert nightly.enforce_parameter_schema and manual.enforce_parameter_schema
        sched = nightly.schedules[0].schedule
        assert sched.cron == "0 2 * * *" and sched.timezone == "Europe/Berlin" and nightly.schedules[0].active
        assert nightly.parameters["start_from"] == "champion" and nightly.parameters["run_name_suffix"] == "date"
        props = nightly.parameter_openapi_schema["properties"]
        assert {"config", "overrides", "start_from", "run_name_suffix"} <= set(props)
    # a parameter outside the schema is refused by the server
    out = _prefect(["deployment", "run", "rlflow-train/manual", "--param", "start_from=yesterday"], server, project)
    assert out.returncode != 0


def test_a_flow_run_is_named_after_the_rlflow_run_unless_it_was_given_a_name(server):
    """The name function of rlflow-train in real flow runs: Prefect's made-up names (the server's `sleek-bison`,
    the run form's suggested `Sleek-Bison`) give way to run.name (dated under run_name_suffix: date); a name typed
    when the flow run was made stays."""
    from datetime import datetime, timezone

    from prefect import flow
    from prefect.flow_engine import run_flow
    from prefect.runtime import flow_run as current

    from flows.training import _flow_run_name

    @flow(name="rlflow-name-probe", flow_run_name=_flow_run_name)
    def probe(config: str, overrides: list[str] | None = None, run_name_suffix: str = "none") -> str:
        return current.name

    config = str(ROOT / "configs" / "tiny.yaml")
    named = {"config": config, "overrides": ["run.name=lr-3e-4"]}
    today = datetime.now(timezone.utc).strftime("%Y%m%d")
    cases = [(None, named, "lr-3e-4"), ("Sleek-Bison", named, "lr-3e-4"), ("lr sweep, 3rd", named, "lr sweep, 3rd"),
             (None, {"config": config, "run_name_suffix": "date"}, f"tiny-demo-{today}"),
             (None, {"config": "no-such.yaml"}, "no-such")]         # (the flow itself refuses that config)
    with _client(server) as client:
        for given, params, want in cases:
            made = client.create_flow_run(probe, name=given, parameters=params)
            assert run_flow(probe, flow_run=made, parameters=params) == want, (given, params)
            assert client.read_flow_run(made.id).name == want


def test_deployment_run_with_overrides_completes_and_fills_the_dashboard(server, project, tmp_path):
    overrides = ["run.name=deployed", "run.iterations=2", "generate.prompts_per_iteration=2",
                 "generate.num_generations=2", f"store.uri={tmp_path}/store",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "eval.every=0",
                 "tracking.dashboard_every=1"]
    out = _prefect(["deployment", "run", "rlflow-train/manual", "--param", f"overrides={json.dumps(overrides)}",
                    "--param", "config=configs/tiny.yaml"], server, project)
    assert out.returncode == 0, out.stdout + out.stderr
    worker = subprocess.Popen([*PREFECT, "worker", "start", "--pool", "rlflow", "--run-once"], env=server,
                              cwd=project, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = worker.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        worker.kill()
        log = worker.communicate()[0]
        pytest.fail("worker did not finish the flow run: " + log[-4000:])

    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter

    with _client(server) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter())
        done = [r for r in runs if r.parameters.get("overrides") == overrides]
        assert done and done[0].state.is_completed(), (done and done[0].state, log[-4000:])
        run = done[0]
        assert run.parameters["config"] == "configs/tiny.yaml"
        assert run.name == "deployed"                          # the rlflow run's name, not Prefect's made-up one
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
        # one artifact, the report, updated in place each iteration (dashboard_every=1): the latest is the only one
        assert [a.key for a in arts] == ["deployed-report"], [a.key for a in arts]
        report = arts[0].data
        assert "deployed — iteration 2/2" in report and "cost" in report and "reward (mean)" in report
        assert "### Reward per iteration" in report and "| 2 |" in report and "| 1 |" in report   # the trend
        assert "policy/v000002" in report and "Samples of iteration 2" in report
        assert "mlflow.db" in report and "/bin/mlflow ui --backend-store-uri sqlite:///" in report
        assert "iteration 2/2" in arts[0].description
        tasks = client.read_task_runs()
        names = {t.name for t in tasks if t.flow_run_id == run.id}
        assert {"generate[iter 1]", "reward[iter 2]", "train[iter 2]", "publish[iter 2]"} <= names
    assert (tmp_path / "store" / "deployed" / "policy" / "v000002" / "MANIFEST.json").exists()

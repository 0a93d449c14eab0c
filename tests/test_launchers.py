"""Where stages run: the recipes in sky/ (validated by SkyPilot itself), the `local` launcher (each stage is
the recipe's own `run` in a subprocess), and the `sky` launcher at its boundary to the SkyPilot SDK (a fake
cloud that runs jobs on this machine: tests/fake_sky). Retries: infrastructure failures are retried and the
run still ends with exactly N iterations; user errors are not retried."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.core.config import load_config
from tasks.scoring.functions import load_functions
from tests.conftest import AT_LENGTH, ROOT, TINY, free_ports, user_module

RECIPES = sorted((ROOT / "sky").glob("*.yaml"))
SKY_PYTHON = ROOT / ".venv-sky" / "bin" / "python"


def test_every_recipe_validates_with_skypilot():
    """SkyPilot's own parser (offline): resources, envs, secrets, num_nodes — what `sky launch` would read."""
    assert {p.stem for p in RECIPES} >= {"generate", "reward", "train", "publish", "evaluate", "pipeline"}
    if not SKY_PYTHON.exists():
        pytest.fail(f"{SKY_PYTHON} missing: `make setup` creates SkyPilot's environment")
    code = ("import sys, json, sky\n"
            "out = {}\n"
            "for p in sys.argv[1:]:\n"
            "    t = sky.Task.from_yaml(p)\n"
            "    out[p] = dict(name=t.name, nodes=t.num_nodes, run=t.run, envs=sorted(t.envs),\n"
            "                  spot=sorted({bool(r.use_spot) for r in t.resources}))\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([str(SKY_PYTHON), "-c", code, *map(str, RECIPES)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    tasks = {Path(k).stem: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    for stage in ("generate", "reward", "train", "publish", "evaluate"):
        assert f"python -m tasks.{stage} " in tasks[stage]["run"]          # the recipe runs the stage's own CLI
        assert {"CONFIG", "OVERRIDES", "ITERATION"} <= set(tasks[stage]["envs"])
        assert tasks[stage]["spot"] == [True]
    assert tasks["pipeline"]["spot"] == [False]                              # the orchestrator must outlive preemptions
    assert "python -m tasks.envs.runtime.server " in tasks["env"]["run"] and tasks["env"]["spot"] == [True]
    assert {"CONFIG", "OVERRIDES", "PORT", "RLFLOW_ENV_TOKEN"} <= set(tasks["env"]["envs"])
    for path in RECIPES:                                                     # credentials are never in a file
        assert "AWS_SECRET_ACCESS_KEY: null" in path.read_text() or "AWS_SECRET_ACCESS_KEY" not in path.read_text()


CATALOG = """\
InstanceType,AcceleratorName,AcceleratorCount,vCPUs,MemoryGiB,GpuInfo,Price,SpotPrice,Region,AvailabilityZone
p4d.24xlarge,A100,8.0,96.0,1152.0,,32.77,12.5,us-east-1,us-east-1a
g5.xlarge,A10G,1.0,4.0,16.0,,1.006,0.4,us-east-1,us-east-1a
g6.xlarge,L4,1.0,4.0,16.0,,0.805,0.35,us-east-1,us-east-1a
m6i.2xlarge,,,8.0,32.0,,0.384,0.15,us-east-1,us-east-1a
m6i.large,,,2.0,8.0,,0.096,0.04,us-east-1,us-east-1a
"""


def test_plan_prices_each_stage_from_skypilots_catalog_and_writes_nothing(tmp_path, monkeypatch, s3_endpoint,
                                                                          bucket):
    """`rlflow plan`: real SkyPilot reads an AWS catalog (written where it caches the downloaded one, as fresh;
    gcp's and azure's cannot be downloaded here): the cheapest fitting machine, spot or on-demand as the recipe
    says, times its nodes; a stage sharing a cluster is not priced twice; no store write, lease or MLflow run.
    (Plan runs run's preflight first: the sky launcher needs an S3 store. tests/test_bad_input.py: the rest.)"""
    if not SKY_PYTHON.exists():
        pytest.fail(f"{SKY_PYTHON} missing: `make setup` creates SkyPilot's environment")
    home = tmp_path / "home"
    (home / ".sky/catalogs/v8/aws").mkdir(parents=True)
    (home / ".sky/catalogs/v8/aws/vms.csv").write_text(CATALOG)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for stage in ("generate", "reward", "train", "publish", "evaluate"):
        text = (ROOT / "sky" / f"{stage}.yaml").read_text()
        if stage == "reward":      # on-demand on 2 nodes, AWS only
            text = text.replace("use_spot: true", "use_spot: false\n  cloud: aws") + "\nnum_nodes: 2\n"
        (recipes / f"{stage}.yaml").write_text(text)
    db = tmp_path / "mlflow.db"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    store = f"s3://{bucket}/runs"
    args = ["plan", str(TINY), "-o", "launcher.where=sky", "-o", f"launcher.recipes={recipes}",
            "-o", f"launcher.sky_python={SKY_PYTHON}", "-o", f"store.uri={store}", "-o",
            f"store.endpoint_url={s3_endpoint}", "-o", "eval.every=5",
            "-o", f"tracking.uri=sqlite:///{db}", "-o", "launcher.stages.publish=local",
            "-o", "cost.hourly_usd.publish=0.25"]
    proc = subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("  ") and line.split()}
    assert "0.350 (SkyPilot catalog: L4:1 aws g6.xlarge)" in rows["generate"]       # cheapest spot of 4 options
    assert "gcp, azure not priced" in rows["generate"] and "spot" in rows["generate"]
    assert "0.768 (SkyPilot catalog: cpus 8+ aws m6i.2xlarge)" in rows["reward"]    # on-demand 0.384 x 2 nodes
    assert "on-demand" in rows["reward"] and "x 2 nodes" in rows["reward"]
    assert "unknown (no machine in the catalog of aws matches" in rows["train"]      # A100:1 is sold only by 8 here
    assert "0.250 (cost.hourly_usd)" in rows["publish"] and "local subprocess" in rows["publish"]
    assert "generate's machine" in rows["evaluate"] and "(in generate's)" in rows["evaluate"]
    assert f"{store}/tiny-demo/" in rows["store:"]
    assert f"sqlite:///{db}" in rows["tracking:"] and "temporary API server" in rows["prefect:"]
    import boto3

    assert boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    assert not db.exists()

    bad = subprocess.run([sys.executable, "-m", "flows.cli", "plan", str(TINY), "-o", "launcher.where=skyy"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "launcher.where" in bad.stderr


def _sky_recipes(tmp_path) -> Path:
    """The repository's recipes (sky/replica.yaml among them), with the trainer on 2 nodes."""
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for path in RECIPES:
        text = path.read_text()
        (recipes / path.name).write_text(text.replace("num_nodes: 1 ", "num_nodes: 2 ") if path.stem == "train"
                                         else text)
    assert "num_nodes: 2 " in (recipes / "train.yaml").read_text()
    return recipes


def test_plan_shows_every_roles_machines_counts_and_the_sky_total(tmp_path, monkeypatch):
    """`rlflow plan` with generate.replicas on sky, 2 environment servers on sky, the trainer on 2 nodes and
    launcher.accelerators {train: A100:8, generate: L4:1}: each role's machine with its count, priced N x one
    (the catalog's price of the GPU type asked for, not the recipe's), and the total of everything on sky."""
    from flows.plan import plan

    if not SKY_PYTHON.exists():
        pytest.fail(f"{SKY_PYTHON} missing: `make setup` creates SkyPilot's environment")
    home = tmp_path / "home"
    (home / ".sky/catalogs/v8/aws").mkdir(parents=True)
    (home / ".sky/catalogs/v8/aws/vms.csv").write_text(CATALOG)
    monkeypatch.setenv("HOME", str(home))
    recipes = _sky_recipes(tmp_path)
    letters = ROOT / "configs" / "letters.yaml"
    common = [f"launcher.recipes={recipes}", f"launcher.sky_python={SKY_PYTHON}", "generate.replicas=3",
              "env.servers=2", "eval.every=5"]
    cfg = load_config(letters, [*common, "launcher.where=sky", "env.where=sky",
                                'launcher.accelerators={train: "A100:8", generate: "L4:1"}'])
    lines = plan(cfg, str(letters)).splitlines()
    row = {name: next(line for line in lines if line.startswith(f"  {name} "))
           for name in ("generate", "generate replicas", "train", "publish", "reward", "evaluate", "env",
                        "total on sky:")}
    assert "routes to the 3 generate replicas" in row["generate"] and "sky cluster" not in row["generate"]
    assert "routes to the 3 generate replicas" in row["evaluate"]
    assert "3 sky clusters rlflow-letters-demo-replica-0..2 (" in row["generate replicas"]
    assert "3 x L4:1; hf engine" in row["generate replicas"]                        # not the recipe's 4 options
    assert "1.050 (SkyPilot catalog: L4:1 aws g6.xlarge), 3 x 0.350" in row["generate replicas"]
    assert "A100:8 x 2 nodes" in row["train"]                                    # the override, on the recipe's nodes
    assert "25.000 (SkyPilot catalog: A100:8 aws p4d.24xlarge), 2 nodes x 12.500" in row["train"]
    assert "(in train's)" in row["publish"]
    assert "0.150 (SkyPilot catalog: cpus 8+" in row["reward"]
    assert "2 environment servers" in row["env"] and "2 x cpus 4+, memory 8+" in row["env"]
    assert "0.300 (SkyPilot catalog: cpus 4+ aws m6i.2xlarge), 2 x 0.150" in row["env"]
    assert "total on sky: 26.500 USD/hour" in row["total on sky:"]               # 25 + 1.05 + 0.15 + 0.3
    assert "(reward, train, generate replicas, env)" in row["total on sky:"]

    here = load_config(letters, [*common, "launcher.where=local", "env.where=local"])
    lines = plan(here, str(letters)).splitlines()                 # nothing on sky: no catalog asked, no total
    replicas = next(line for line in lines if line.startswith("  generate replicas "))
    assert "3 local processes" in replicas and "this machine" in replicas
    assert "2 environment servers behind one URL, processes beside the flow" in "\n".join(lines)
    assert not [line for line in lines if "total on sky" in line]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_validates_and_names_what_exists(path):
    """Beyond the schema: its reward functions import, its local data files exist, its stage recipes exist."""
    cfg = load_config(path, [])
    functions = load_functions(cfg)
    assert functions.names == [spec.fn.split(":")[1] for spec in cfg.reward.functions]
    for data_path in (cfg.data.path, cfg.eval.path):
        if data_path and (data_path.startswith("/") or data_path.endswith((".jsonl", ".json", ".csv", ".parquet"))):
            assert Path(data_path).is_file(), data_path
    for stage in cfg.launcher.remote_stages():
        assert (ROOT / cfg.launcher.recipes / f"{stage}.yaml").is_file(), stage


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "spaces").glob("*.yaml")), ids=lambda p: p.name)
def test_every_tune_space_validates_against_the_config_of_its_name(path):
    from flows.tune_space import load_space

    assert load_space(str(path), str(ROOT / "configs" / path.name), [])


# ---------------------------------------------------------------------------------------------- local launcher

KILLER = '''
import os, signal
from pathlib import Path

def reward(completions, **kw):
    """Kills its stage process the first {n} times it runs (a lost machine), then scores 0.5. Reward functions
    run in the stage's reward worker (tasks/scoring/worker.py): the stage process is the parent of the worker's
    keeper, the worker's parent."""
    marker = Path(os.environ["KILL_DIR"]) / "kills"
    done = int(marker.read_text()) if marker.exists() else 0
    if done < {n}:
        marker.write_text(str(done + 1))
        keeper = Path(f"/proc/{os.getppid()}/stat").read_text()
        os.kill(int(keeper.rsplit(")", 1)[1].split()[1]), signal.SIGKILL)
    return [0.5] * len(completions)

def wrong_length(completions, **kw):
    calls = Path(os.environ["KILL_DIR"]) / "calls"
    calls.write_text(str(int(calls.read_text()) + 1 if calls.exists() else 1))
    return [1.0]
'''


def _small(tmp_path, name: str, extra: list[str] = ()) -> list[str]:
    return [f"run.name={name}", "run.iterations=2", "generate.prompts_per_iteration=2", "generate.num_generations=2",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=2",
            f"launcher.recipes={ROOT / 'sky'}", "launcher.retry_backoff_seconds=0", *extra]


@pytest.fixture
def killer_module(tmp_path, monkeypatch):
    return user_module(tmp_path, monkeypatch, "flaky_reward", KILLER.replace("{n}", "2"))


@pytest.mark.slow
@pytest.mark.drill
@AT_LENGTH                      # (make test runs the local launcher's recipes in test_local_launcher_does_not_retry...)
def test_local_launcher_runs_the_recipes_and_survives_two_kills(prefect_api, tmp_path, monkeypatch, killer_module):
    """Every stage is its recipe's `run` in a subprocess; the reward process is SIGKILLed twice in this flow
    run; the retries (with the store's reuse) still end with exactly 2 iterations."""
    from flows.training import train_flow
    from tasks.core.store import Store

    monkeypatch.chdir(tmp_path)
    overrides = _small(tmp_path, "local", ["launcher.where=local", f"store.uri={tmp_path}/store",
                                           'reward.functions=[{"fn": "flaky_reward:reward"}]'])
    summary = train_flow(str(TINY), overrides)
    assert (tmp_path / "kills").read_text() == "2"
    assert summary["iterations_completed"] == 2 and summary["reward_mean"] == [0.5, 0.5]
    store = Store.open(load_config(TINY, overrides).store)
    assert store.list_folders("local/policy") == ["v000001", "v000002"]
    assert store.get_pointer("local/policy/LATEST") == "local/policy/v000002"


@pytest.mark.slow
def test_local_launcher_does_not_retry_a_user_error(prefect_api, tmp_path, monkeypatch, killer_module):
    from flows.training import train_flow
    from tasks.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    overrides = _small(tmp_path, "usererr", ["launcher.where=local", "launcher.retries=3",
                                             f"store.uri={tmp_path}/store",
                                             'reward.functions=[{"fn": "flaky_reward:wrong_length"}]',
                                             "reward.strict=true"])
    with pytest.raises(UserError, match="wrong_length"):
        train_flow(str(TINY), overrides)
    assert (tmp_path / "calls").read_text() == "1"                 # one attempt: no retry
    assert not (tmp_path / "store" / "usererr" / "iter-000001" / "rewards").exists()


# ---------------------------------------------------------------------------------------------- sky launcher



def _sky(tmp_path, s3_endpoint, bucket, cloud, name, extra=()):
    return _small(tmp_path, name, ["launcher.where=sky", f"launcher.sky_python={cloud.python}",
                                   f"store.uri=s3://{bucket}/runs", f"store.endpoint_url={s3_endpoint}",
                                   "run.iterations=1", *extra])


@pytest.mark.slow
def test_sky_launcher_launches_once_execs_after_and_tears_down(prefect_api, tmp_path, monkeypatch, s3_endpoint,
                                                                 bucket, fake_cloud):
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    summary = train_flow(str(TINY), _sky(tmp_path, s3_endpoint, bucket, fake_cloud, "sky1",
                                         ["run.iterations=2", "eval.every=2", "eval.max_prompts=2"]))
    assert summary["iterations_completed"] == 2
    calls = fake_cloud.calls()
    launches = [c for c in calls if c["call"] == "launch"]
    assert sorted(c["cluster"] for c in launches) == ["rlflow-sky1-gen", "rlflow-sky1-reward", "rlflow-sky1-train"]
    execs = [(c["task"], c["envs"]["ITERATION"]) for c in calls if c["call"] == "exec"]
    assert ("rlflow-generate", "2") in execs and ("rlflow-evaluate", "2") in execs
    assert all(c["secrets"] == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"] for c in launches)  # from the env
    assert all(json.loads(c["envs"]["OVERRIDES"]) for c in launches)        # the flow's overrides travel
    downs = sorted(c["cluster"] for c in calls if c["call"] == "down")
    assert downs == sorted(c["cluster"] for c in launches)                  # torn down at the end
    assert summary["cost_usd"] > 0                                         # priced from the launched resources


@pytest.mark.slow
@AT_LENGTH                      # (a fault drill: make test keeps launch/exec/teardown, give-up and user errors)
def test_sky_launcher_relaunches_a_vanished_cluster_and_retries_a_failed_job(prefect_api, tmp_path, monkeypatch,
                                                                              s3_endpoint, bucket, fake_cloud):
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    fake_cloud.scenario(vanish={"train": 1}, fail={"reward": 1})
    summary = train_flow(str(TINY), _sky(tmp_path, s3_endpoint, bucket, fake_cloud, "sky2"))
    assert summary["iterations_completed"] == 1
    calls = fake_cloud.calls()
    train_launches = [c for c in calls if c["call"] == "launch" and c["cluster"] == "rlflow-sky2-train"]
    assert len(train_launches) == 2                                         # launched again after it vanished
    reward_jobs = [c for c in calls if c.get("task") == "rlflow-reward" and c["call"] in ("launch", "exec")]
    assert len(reward_jobs) == 2                                            # a failed job is retried


@pytest.mark.slow
def test_sky_launcher_gives_up_after_retries_and_still_tears_down(prefect_api, tmp_path, monkeypatch, s3_endpoint,
                                                                   bucket, fake_cloud):
    from flows.launch import InfraError
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    fake_cloud.scenario(fail={"generate": 10})
    with pytest.raises(InfraError, match="exit code 100"):
        train_flow(str(TINY), _sky(tmp_path, s3_endpoint, bucket, fake_cloud, "sky3", ["launcher.retries=2"]))
    calls = fake_cloud.calls()
    assert len([c for c in calls if c.get("task") == "rlflow-generate"]) == 3   # 1 + 2 retries
    assert [c["cluster"] for c in calls if c["call"] == "down"] == ["rlflow-sky3-gen"]


@pytest.mark.slow
def test_sky_launcher_user_error_is_not_retried(prefect_api, tmp_path, monkeypatch, s3_endpoint, bucket,
                                                fake_cloud, killer_module):
    from flows.training import train_flow
    from tasks.core.errors import UserError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="wrong_length"):
        train_flow(str(TINY), _sky(tmp_path, s3_endpoint, bucket, fake_cloud, "sky4",
                                   ['reward.functions=[{"fn": "flaky_reward:wrong_length"}]', "reward.strict=true"]))
    assert (tmp_path / "calls").read_text() == "1"
    assert len([c for c in fake_cloud.calls() if c.get("task") == "rlflow-reward"]) == 1


SERVER = """
import http.server, os
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Ok).serve_forever()
"""


def test_sky_launcher_asks_for_each_roles_gpu_type(tmp_path, fake_cloud):
    """launcher.accelerators replaces each recipe's accelerators (here a dict of 2 options) with the role's GPU
    type: a stage's cluster, a stage sharing it (same machine), a managed job, a generate replica's server."""
    from flows.launch import Sky

    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (tmp_path / "server.py").write_text(SERVER)
    for role in ("train", "publish", "reward", "evaluate", "replica"):
        run = f"python3 {tmp_path / 'server.py'}" if role == "replica" else f"echo {role} ran"
        (recipes / f"{role}.yaml").write_text(f"name: rlflow-{role}\nresources:\n  accelerators: {{L4: 1, A10G: 1}}\n"
                                              f"run: {run}\n")
    common = ["launcher.where=sky", f"launcher.recipes={recipes}", f"launcher.sky_python={fake_cloud.python}",
              "run.name=gpus"]
    gpus = 'launcher.accelerators={train: "A100:8", generate: "L4:1"}'
    sky, log = Sky(load_config(TINY, [*common, gpus])), []
    try:
        for stage in ("train", "publish", "evaluate", "reward"):
            sky.run(stage, 1, {"ITERATION": "1"}, log.append)
        port = free_ports(1)
        assert sky.serve("replica", port, 60, {"PORT": port}, log.append) == f"http://127.0.0.1:{port}"
    finally:
        sky.close(log.append)
    managed = Sky(load_config(TINY, [*common, "launcher.managed_jobs=true", 'launcher.accelerators={train: "A100:8"}']))
    managed.run("train", 1, {"ITERATION": "1"}, log.append)
    managed.run("evaluate", 1, {"ITERATION": "1"}, log.append)
    asked = [(c["call"], c.get("cluster") or c.get("name"), c["accelerators"]) for c in fake_cloud.calls()
             if "accelerators" in c]
    assert asked == [("launch", "rlflow-gpus-train", "A100:8"),
                     ("exec", "rlflow-gpus-train", "A100:8"),                 # publish: on train's machine
                     ("launch", "rlflow-gpus-gen", "L4:1"),                   # evaluate: generate's machine
                     ("launch", "rlflow-gpus-reward", {"L4": 1, "A10G": 1}),  # no override: the recipe's
                     ("launch", "rlflow-gpus-replica", "L4:1"),               # a replica is a generate machine
                     ("jobs.launch", "rlflow-gpus-train-train-1", "A100:8"),
                     ("jobs.launch", "rlflow-gpus-gen-evaluate-1", {"L4": 1, "A10G": 1})]  # its own job: its own


def _echo_recipes(tmp_path) -> Path:
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    for role in ("generate", "train", "reward"):
        (recipes / f"{role}.yaml").write_text(f"name: rlflow-{role}\nrun: echo {role} ran\n")
    return recipes


def test_each_run_and_role_gets_a_cluster_of_its_own(tmp_path, fake_cloud):
    """Run names that differ only in case or `_` (Run_A, run-a) get clusters of their own, and the end of one run
    tears down only its own; a run name past the cut (60 characters) still gets one cluster per role, each with
    its GPU type (was: one cluster, launched with generate's L4 and train's A100:8 sent to it)."""
    from flows.launch import Sky

    common = ["launcher.where=sky", f"launcher.recipes={_echo_recipes(tmp_path)}",
              f"launcher.sky_python={fake_cloud.python}"]
    log: list[str] = []
    first, second = (Sky(load_config(TINY, [*common, f"run.name={name}"])) for name in ("Run_A", "run-a"))
    first.run("train", 1, {"ITERATION": "1"}, log.append)
    second.run("train", 1, {"ITERATION": "1"}, log.append)
    first.close(log.append)
    calls = fake_cloud.calls()
    launched = [c["cluster"] for c in calls if c["call"] == "launch"]
    assert len(set(launched)) == 2 and launched[1] == "rlflow-run-a-train"     # (a plain name is kept)
    assert [c["cluster"] for c in calls if c["call"] == "down"] == [launched[0]]    # not run-a's
    second.close(log.append)
    before = len(fake_cloud.calls())

    gpus = 'launcher.accelerators={generate: "L4:1", train: "A100:8"}'
    long = Sky(load_config(TINY, [*common, "run.name=" + "n" * 60, gpus]))
    try:
        for stage in ("generate", "train", "reward"):
            long.run(stage, 1, {"ITERATION": "1"}, log.append)
    finally:
        long.close(log.append)
    asked = [(c["call"], c["accelerators"]) for c in fake_cloud.calls()[before:] if "accelerators" in c]
    assert asked == [("launch", "L4:1"), ("launch", "A100:8"), ("launch", None)]
    assert len({c["cluster"] for c in fake_cloud.calls()[before:] if c["call"] == "launch"}) == 3


def test_cluster_names_are_skypilots_unique_and_plain_ones_kept():
    """flows/launch.py cluster_name, every cluster's name: within SkyPilot's rule and 60 characters, one per
    (run name, role, member) for names that once collided (case, `_`, `.`, past the cut; run `a`'s judge `gen`
    and run `a-judge`'s generate cluster), and a plain short run name's names as they were (a resumed run finds
    its clusters)."""
    import re

    from flows.launch import Sky

    runs = ["sky1", "Run_A", "run-a", "RUN.A", "run_a", "a", "a-judge", "9lives", "n" * 52, "n" * 53, "n" * 60,
            "n" * 61, "N" * 100]
    names = {(run, stage): Sky(load_config(TINY, [f"run.name={run}"])).cluster(stage) for run in runs
             for stage in ("generate", "reward", "train", "env")}    # (judge, replica: with a member)
    assert len(set(names.values())) == len(names)
    from flows.launch import cluster_name

    members = [("env", "front"), ("env", "0"), ("replica", "0"), ("replica", "11"), ("judge", "gen"),
               ("judge", "judge"), ("judge", "My_Judge"), ("judge", "my-judge"), ("judge", "x-env-front")]
    served = {(run, role, m): cluster_name("rlflow", run, role, m) for run in runs for role, m in members}
    every = [*names.values(), *served.values()]
    assert len(set(every)) == len(every)
    assert all(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 60 for n in every), every
    assert [names["sky1", s] for s in ("generate", "train")] == ["rlflow-sky1-gen", "rlflow-sky1-train"]
    assert served["a", "replica", "11"] == "rlflow-a-replica-11" and served["a", "env", "front"] == "rlflow-a-env-front"
    assert served["a", "judge", "judge"] == "rlflow-a-judge-judge"


def test_sky_launcher_needs_a_shared_store(tmp_path):
    from flows.training import preflight
    from tasks.core.errors import UserError

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "launcher.where=sky",
                             f"launcher.recipes={ROOT / 'sky'}"])
    with pytest.raises(UserError, match="store.uri: .*s3://"):
        preflight(cfg)


@AT_LENGTH
@pytest.mark.slow
def test_sky_launcher_managed_jobs_mode(prefect_api, tmp_path, monkeypatch, s3_endpoint, bucket, fake_cloud):
    """launcher.managed_jobs: every stage is a SkyPilot managed job (SkyPilot recovers spot preemptions); no
    clusters of our own to launch or tear down."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    summary = train_flow(str(TINY), _sky(tmp_path, s3_endpoint, bucket, fake_cloud, "sky5",
                                         ["launcher.managed_jobs=true", "eval.every=0"]))
    assert summary["iterations_completed"] == 1
    calls = fake_cloud.calls()
    assert [c["task"] for c in calls if c["call"] == "jobs.launch"] == \
        ["rlflow-generate", "rlflow-reward", "rlflow-train", "rlflow-publish"]
    assert not [c for c in calls if c["call"] in ("launch", "exec", "down")]


@pytest.mark.drill
def test_a_local_stage_process_that_stops_beating_is_killed_and_the_retry_runs_it(tmp_path, monkeypatch):
    """launcher.where local: a stage process SIGSTOPped (a process that neither answers nor ends) hung the run
    for good: the launcher read its output until the end. It beats from its first moment (tasks/__init__.py),
    and the beats stop with it: killed after HUNG_SECONDS, with what it started, an infrastructure failure
    (retried). Run again and not stopped, it beats through its imports and its work, and completes."""
    import os
    import signal
    import tempfile
    import threading
    import time

    from flows.launch import InfraError, Local, stage_env
    from tasks.core.processes import alive, descendants

    monkeypatch.setattr(Local, "HUNG_SECONDS", 12.0)         # (beats come every 5 s)
    monkeypatch.setattr(Local, "WATCH_SECONDS", 0.2)
    monkeypatch.chdir(tmp_path)
    overrides = [f"store.uri={tmp_path}/store", "run.name=beat", "launcher.where=local"]
    cfg = load_config(TINY, overrides)
    env = stage_env(str(TINY), overrides, 1)
    stopped: list[int] = []
    made: dict[str, int] = {}               # the heartbeat file, and its time when the launcher made it
    real = tempfile.NamedTemporaryFile

    def recorded(*args, **kwargs):
        f = real(*args, **kwargs)
        made[f.name] = os.stat(f.name).st_mtime_ns
        return f
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", recorded)

    def stop_the_stage() -> None:            # its Python, once it has beaten (the file touched after it was made)
        deadline = time.monotonic() + 120
        while not made and time.monotonic() < deadline:
            time.sleep(0.01)
        (beat, at), = made.items()
        while os.stat(beat).st_mtime_ns == at and time.monotonic() < deadline:
            time.sleep(0.01)
        while time.monotonic() < deadline:
            for pid in descendants(os.getpid()):
                try:
                    if b"-m\0tasks.generate" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGSTOP)
                        stopped.append(pid)
                        return
                except OSError:
                    continue
            time.sleep(0.01)

    watcher = threading.Thread(target=stop_the_stage, daemon=True)
    watcher.start()
    lines: list[str] = []
    with pytest.raises(InfraError, match=r"generate\[iter 1\]: the local stage process gave no heartbeat for \d+ s "
                                         r"\(stopped by a signal, or wedged\): killed; a retry runs it again"):
        Local(cfg).run("generate", 1, env, lines.append)
    watcher.join(5)
    assert stopped and not alive(stopped[0])
    Local(cfg).run("generate", 1, env, lines.append)        # the retry, not stopped: beating all along
    assert (tmp_path / "store" / "beat" / "iter-000001" / "rollouts").is_dir()


def test_a_local_stage_stopped_before_its_first_beat_is_killed_too(tmp_path, monkeypatch):
    """A stage whose recipe is stopped before its Python starts (here the recipe's shell stops itself; a SIGSTOP
    or Ctrl-Z of that process alike) never beats: nothing was timed before the first beat, and the run waited for
    good. Every process of the stage stopped for HUNG_SECONDS of checks is a hung stage too: killed, an
    infrastructure failure (retried). A recipe at work before its first beat (installing) is not stopped, and waits."""
    import os
    import signal
    import threading

    from flows.launch import InfraError, Local, stage_env
    from tasks.core.processes import alive

    monkeypatch.setattr(Local, "HUNG_SECONDS", 1.0)
    monkeypatch.setattr(Local, "WATCH_SECONDS", 0.2)
    monkeypatch.chdir(tmp_path)
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "generate.yaml").write_text("run: |\n  echo $$ > stopped.pid\n  kill -STOP $$\n  echo never\n")
    overrides = [f"store.uri={tmp_path}/store", "run.name=stopped", "launcher.where=local",
                 f"launcher.recipes={recipes}"]
    cfg = load_config(TINY, overrides)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            Local(cfg).run("generate", 1, stage_env(str(TINY), overrides, 1), lambda line: None)
        except BaseException as e:  # noqa: BLE001 - what the test reads
            raised.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)                 # (a bound for the old behaviour, which waited for good; it ends in ~1-2 s)
    pid = int((tmp_path / "stopped.pid").read_text())
    if t.is_alive():
        os.kill(pid, signal.SIGKILL)
    assert not t.is_alive(), "the launcher still waits on a stage stopped before its first beat"
    assert len(raised) == 1 and isinstance(raised[0], InfraError), raised
    assert "gave no heartbeat for" in str(raised[0]) and not alive(pid)

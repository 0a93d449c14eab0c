"""A fake SkyPilot SDK: the cloud is the only thing faked in rlflow's tests.

It has the surface flows/sky_bridge.py uses (Task.from_yaml_config, launch, exec, stream_and_get, tail_logs,
status, get, down, jobs.launch, jobs.tail_logs, exceptions) and runs each job's `run` for real, on this
machine, with the task's envs and secrets — so a flow on the `sky` launcher really trains. Every call is
appended to $FAKE_SKY_DIR/calls.jsonl for the test to read.

Scenarios, from $FAKE_SKY_DIR/scenario.json:
  {"vanish": {"train": 1}}   the first train job's cluster disappears mid-job (the job is killed, the cluster
                             reports missing; exec on it raises ClusterDoesNotExist until it is launched again)
  {"fail": {"reward": 2}}    the first 2 reward jobs exit non-zero (a crash, not a user error)
"""

from __future__ import annotations

import enum
import json
import os
import subprocess
import sys
from pathlib import Path

__version__ = "0.0-fake"
_DIR = Path(os.environ["FAKE_SKY_DIR"])
_STATE = _DIR / "state.json"        # clusters up, job results, scenario counters (across bridge processes)


class exceptions:  # noqa: N801 - mirrors sky.exceptions
    class ClusterDoesNotExist(ValueError):
        pass

    class ClusterNotUpError(Exception):
        pass


class StatusRefreshMode(enum.Enum):
    NONE = "NONE"
    FORCE = "FORCE"


def _state() -> dict:
    return json.loads(_STATE.read_text()) if _STATE.exists() else {"clusters": {}, "jobs": {}, "counts": {}}


def _save(state: dict) -> None:
    _STATE.write_text(json.dumps(state))


def _scenario() -> dict:
    path = _DIR / "scenario.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _call(call: str, **kw) -> None:
    with open(_DIR / "calls.jsonl", "a") as f:
        f.write(json.dumps({"call": call, **kw}) + "\n")


class Task:
    def __init__(self, config: dict):
        self.name = config.get("name")
        self.run = config["run"]
        self.envs = {k: str(v) for k, v in (config.get("envs") or {}).items() if v is not None}
        self.secrets = {k: v for k, v in (config.get("secrets") or {}).items() if v is not None}

    @classmethod
    def from_yaml_config(cls, config, env_overrides=None, secrets_overrides=None):
        task = cls(config)
        task.envs.update(dict(env_overrides or []))
        task.secrets.update(dict(secrets_overrides or []))
        return task


class _Handle:
    class launched_resources:  # noqa: N801
        @staticmethod
        def get_cost(seconds):
            return 0.5 * seconds / 3600        # a $0.50/h machine

    launched_nodes = 1


def _submit(task: Task, cluster: str) -> dict:
    state = _state()
    job_id = len(state["jobs"]) + 1
    stage = (task.name or "").replace("rlflow-", "")
    counts = state["counts"]
    counts[stage] = counts.get(stage, 0) + 1
    scenario = _scenario()
    env = {**os.environ, **task.envs, **task.secrets, "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NUM_NODES": "1",
           "SKYPILOT_NODE_IPS": "127.0.0.1"}
    if counts[stage] <= scenario.get("vanish", {}).get(stage, 0):
        state["clusters"].pop(cluster, None)           # preempted: the job dies with its machine
        code, log = 137, "fake cloud: the machine was preempted\n"
    elif counts[stage] <= scenario.get("fail", {}).get(stage, 0):
        code, log = 1, "fake cloud: the job crashed\n"
    else:
        proc = subprocess.run(["bash", "-c", task.run], env=env, capture_output=True, text=True)
        code, log = proc.returncode, proc.stdout + proc.stderr
    state["jobs"][str(job_id)] = {"cluster": cluster, "code": code, "log": log}
    _save(state)
    return {"job_id": job_id}


def launch(task, cluster_name=None, retry_until_up=False, idle_minutes_to_autostop=None, **kw):
    _call("launch", cluster=cluster_name, task=task.name, envs=task.envs, secrets=sorted(task.secrets),
          idle_minutes_to_autostop=idle_minutes_to_autostop)
    state = _state()
    state["clusters"][cluster_name] = "UP"
    _save(state)
    return ("job", _submit(task, cluster_name))


def exec(task, cluster_name=None, **kw):  # noqa: A001 - the SDK's name
    _call("exec", cluster=cluster_name, task=task.name, envs=task.envs)
    if cluster_name not in _state()["clusters"]:
        raise exceptions.ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")
    return ("job", _submit(task, cluster_name))


def stream_and_get(request_id=None, output_stream=None, **kw):
    kind, payload = request_id
    if kind == "job":
        return payload["job_id"], _Handle()
    if kind == "managed":
        return [payload["job_id"]], _Handle()
    return payload


def get(request_id):
    return stream_and_get(request_id)


def tail_logs(cluster_name, job_id, follow=True, output_stream=None, **kw):
    job = _state()["jobs"][str(job_id)]
    (output_stream or sys.stderr).write(job["log"])
    return 0 if job["code"] == 0 else 100          # SkyPilot's JobExitCode: SUCCEEDED 0, FAILED 100


def status(cluster_names=None, refresh=None, **kw):
    clusters = _state()["clusters"]
    return ("value", [{"name": c, "status": clusters[c]} for c in (cluster_names or clusters) if c in clusters])


def down(cluster_name, **kw):
    _call("down", cluster=cluster_name)
    state = _state()
    if state["clusters"].pop(cluster_name, None) is None:
        raise exceptions.ClusterDoesNotExist(cluster_name)
    _save(state)
    return ("value", None)


class jobs:  # noqa: N801 - mirrors sky.jobs
    @staticmethod
    def launch(task, name=None, **kw):
        _call("jobs.launch", name=name, task=task.name)
        return ("managed", _submit(task, f"managed-{name}"))

    @staticmethod
    def tail_logs(name=None, job_id=None, follow=True, output_stream=None, **kw):
        return tail_logs(None, job_id, output_stream=output_stream)

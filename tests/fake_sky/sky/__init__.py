"""A fake SkyPilot SDK: the cloud is the only thing faked in rlflow's tests.

It has the surface flows/sky_bridge.py uses (Task.from_yaml_config, launch, exec, stream_and_get, tail_logs,
status, get, down, endpoints, job_status, cancel, jobs.launch, jobs.tail_logs, exceptions) and runs each job's
`run` for real, on this machine, with the task's envs and secrets — so a flow on the `sky` launcher really
trains. As in SkyPilot, a job runs detached from the call that submitted it (a process group of its own;
tail_logs(follow=True) waits for it), so a server job (sky/env.yaml) keeps running; a cluster's
`resources.ports` are its endpoints, on 127.0.0.1. Every call is appended to $FAKE_SKY_DIR/calls.jsonl for the
test to read (with the task's resources.accelerators: what the machine was asked to have). `preempt(cluster)`
(from a test) kills a cluster's jobs and removes it, as a spot reclaim would.

Scenarios, from $FAKE_SKY_DIR/scenario.json:
  {"vanish": {"train": 1}}   the first train job's cluster disappears mid-job (the job is killed, the cluster
                             reports missing; exec on it raises ClusterDoesNotExist until it is launched again)
  {"fail": {"reward": 2}}    the first 2 reward jobs exit non-zero (a crash, not a user error)
"""

from __future__ import annotations

import enum
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

__version__ = "0.0-fake"
_DIR = Path(os.environ["FAKE_SKY_DIR"])
CLUSTER_NAME_VALID_REGEX = "[a-zA-Z]([-_.a-zA-Z0-9]*[a-zA-Z0-9])?"     # (sky.skylet.constants')
_STATE = _DIR / "state.json"        # clusters up, job results, scenario counters (across bridge processes)


class exceptions:  # noqa: N801 - mirrors sky.exceptions
    class ClusterDoesNotExist(ValueError):
        pass

    class ClusterNotUpError(Exception):
        pass

    class InvalidClusterNameError(ValueError):
        pass


class JobStatus(enum.Enum):
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


class StatusRefreshMode(enum.Enum):
    NONE = "NONE"
    FORCE = "FORCE"


def _state() -> dict:
    return json.loads(_STATE.read_text()) if _STATE.exists() else {"clusters": {}, "jobs": {}, "counts": {}}


def _save(state: dict) -> None:
    tmp = _STATE.with_suffix(f".{os.getpid()}.tmp")    # (whole or not at all: bridges run side by side)
    tmp.write_text(json.dumps(state))
    os.replace(tmp, _STATE)


def _one_at_a_time(fn):
    """A call that reads, changes and writes the cloud's state holds its lock: several bridge processes at once
    (a flow launching three replica clusters together) must not lose each other's changes."""
    import fcntl
    import functools

    @functools.wraps(fn)
    def locked(*args, **kw):
        with open(_DIR / "state.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return fn(*args, **kw)
    return locked


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
        ports = (config.get("resources") or {}).get("ports") or []
        self.accelerators = (config.get("resources") or {}).get("accelerators")   # what the machine must have
        self.ports = [int(p) for p in (ports if isinstance(ports, list) else [ports])]

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
    else:                                               # detached, as SkyPilot's job queue runs it
        jobs = _DIR / "jobs"
        jobs.mkdir(exist_ok=True)
        out, done = jobs / f"{job_id}.log", jobs / f"{job_id}.code"
        script = 'bash -c "$FAKE_SKY_RUN" >"$FAKE_SKY_LOG" 2>&1; echo $? >"$FAKE_SKY_CODE"'
        proc = subprocess.Popen(["bash", "-c", script],
                                env={**env, "FAKE_SKY_RUN": task.run, "FAKE_SKY_LOG": str(out),
                                     "FAKE_SKY_CODE": str(done)},
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        state["jobs"][str(job_id)] = {"cluster": cluster, "pgid": proc.pid, "log_path": str(out),
                                      "code_path": str(done)}
        state.setdefault("ports", {})[cluster] = task.ports
        _save(state)
        return {"job_id": job_id}
    state["jobs"][str(job_id)] = {"cluster": cluster, "code": code, "log": log}
    _save(state)
    return {"job_id": job_id}


def _code(job: dict) -> int | None:
    """A job's exit code, None while it runs."""
    if "code" in job:
        return job["code"]
    text = Path(job["code_path"]).read_text().strip() if Path(job["code_path"]).exists() else ""
    if text:
        return int(text)
    try:
        os.killpg(job["pgid"], 0)
    except ProcessLookupError:
        return 137                                   # killed with its machine
    return None


def _log(job: dict) -> str:
    return job["log"] if "log" in job else Path(job["log_path"]).read_text()


def _kill_jobs(state: dict, cluster: str) -> None:
    for job in state["jobs"].values():
        if job["cluster"] == cluster and "pgid" in job:
            try:
                os.killpg(job["pgid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


@_one_at_a_time
def preempt(cluster: str) -> None:
    """The cloud takes the machine back: its jobs die, and the cluster is gone."""
    _call("preempted", cluster=cluster)
    state = _state()
    _kill_jobs(state, cluster)
    state["clusters"].pop(cluster, None)
    _save(state)


@_one_at_a_time
def launch(task, cluster_name=None, retry_until_up=False, idle_minutes_to_autostop=None, **kw):
    _call("launch", cluster=cluster_name, task=task.name, envs=task.envs, secrets=sorted(task.secrets),
          idle_minutes_to_autostop=idle_minutes_to_autostop, accelerators=task.accelerators)
    if not re.fullmatch(CLUSTER_NAME_VALID_REGEX, cluster_name or ""):      # (sky.utils.common_utils's check)
        raise exceptions.InvalidClusterNameError(f'Cluster name "{cluster_name}" is invalid')
    state = _state()
    state["clusters"][cluster_name] = "UP"
    _save(state)
    return ("job", _submit(task, cluster_name))


@_one_at_a_time
def exec(task, cluster_name=None, **kw):  # noqa: A001 - the SDK's name
    _call("exec", cluster=cluster_name, task=task.name, envs=task.envs, accelerators=task.accelerators)
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
    while follow and _code(job) is None:
        time.sleep(0.05)
    (output_stream or sys.stderr).write(_log(job))
    return 0 if _code(job) == 0 else 100          # SkyPilot's JobExitCode: SUCCEEDED 0, FAILED 100


def job_status(cluster_name, job_ids=None, **kw):
    jobs = _state()["jobs"]
    out = {}
    for job_id in job_ids or []:
        code = _code(jobs[str(job_id)])
        out[job_id] = JobStatus.RUNNING if code is None else JobStatus.SUCCEEDED if code == 0 else JobStatus.FAILED
    return ("value", out)


def endpoints(cluster, port=None, **kw):
    state = _state()
    if cluster not in state["clusters"]:
        raise ValueError(f"Cluster {cluster!r} is not UP.")
    ports = state.get("ports", {}).get(cluster) or []
    if not ports:
        raise RuntimeError(f"Cluster {cluster!r} has no ports to be exposed.")
    return ("value", {p: f"127.0.0.1:{p}" for p in ports if port is None or int(port) == p})


@_one_at_a_time
def cancel(cluster_name, all=False, job_ids=None, **kw):  # noqa: A002 - the SDK's name
    _call("cancel", cluster=cluster_name, job_ids=job_ids, all=all)
    state = _state()
    if all:
        job_ids = [i for i, job in state["jobs"].items() if job.get("cluster") == cluster_name]
    for job_id in job_ids or []:
        job = state["jobs"].get(str(job_id), {})
        if "pgid" in job:
            try:
                os.killpg(job["pgid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    return ("value", None)


def status(cluster_names=None, refresh=None, **kw):
    clusters = _state()["clusters"]
    return ("value", [{"name": c, "status": clusters[c]} for c in (cluster_names or clusters) if c in clusters])


@_one_at_a_time
def down(cluster_name, **kw):
    _call("down", cluster=cluster_name)
    state = _state()
    if state["clusters"].pop(cluster_name, None) is None:
        raise exceptions.ClusterDoesNotExist(cluster_name)
    _kill_jobs(state, cluster_name)
    _save(state)
    return ("value", None)


class jobs:  # noqa: N801 - mirrors sky.jobs
    @staticmethod
    def launch(task, name=None, **kw):
        _call("jobs.launch", name=name, task=task.name, accelerators=task.accelerators)
        return ("managed", _submit(task, f"managed-{name}"))

    @staticmethod
    def tail_logs(name=None, job_id=None, follow=True, output_stream=None, **kw):
        return tail_logs(None, job_id, output_stream=output_stream)

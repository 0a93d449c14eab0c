"""The `sky` launcher's hands on the SkyPilot SDK. Runs under the SkyPilot environment's Python (SkyPilot pins
click and uvicorn below what the rest of rlflow needs, so it lives in its own venv, `.venv-sky`), imports only
`sky`, the standard library and tasks/core/errors.py (standard library only), and answers with one JSON line
on stdout after the job's logs.

    python flows/sky_bridge.py run  --cluster C --recipe sky/train.yaml [--env K=V]... [--launch]
                                    [--idle-minutes 10]
    python flows/sky_bridge.py job  --name N --recipe sky/train.yaml [--env K=V]...     # managed job
    python flows/sky_bridge.py down --cluster C

`run` launches the cluster (`--launch`: first use in a flow run, or after it vanished) or reuses it with
`sky.exec`, streams the job's logs to stderr, and reports
    {"exit_code": 0|100|..., "user_error": "..."|null, "cluster_missing": bool, "hourly_usd": float|null}
SkyPilot's exit code says only succeeded (0) or failed (100); whether the failure was the user's (a stage
exits 2 after printing `RLFLOW_USER_ERROR: <line>`) is read from the streamed log, and whether the machine
went away (preemption) from the cluster's status after the job ended.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))     # this checkout's `tasks` (not installed here)
from tasks.core.errors import user_error_in  # noqa: E402


class Tee(io.TextIOBase):
    """Log stream: forwards to stderr, remembers a user-error line."""

    def __init__(self):
        self.user_error = None
        self._buf = ""

    def write(self, s):
        sys.stderr.write(s)
        self._buf += s
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self.user_error = user_error_in(line) or self.user_error
        return len(s)

    def flush(self):
        sys.stderr.flush()


def _task(sky, recipe: str, envs: list[str]):
    """The recipe with the flow's envs; its secrets (null in the file) filled from this process's environment,
    as `sky launch --secret NAME` does."""
    import os

    import yaml

    with open(recipe) as f:
        config = yaml.safe_load(f)
    secrets = [(k, os.environ[k]) for k in (config.get("secrets") or {}) if os.environ.get(k)]
    return sky.Task.from_yaml_config(config, env_overrides=[tuple(e.split("=", 1)) for e in envs],
                                     secrets_overrides=secrets)


def _cluster_up(sky, cluster: str) -> bool:
    records = sky.get(sky.status([cluster], refresh=sky.StatusRefreshMode.FORCE))
    for r in records or []:
        name = r["name"] if isinstance(r, dict) else getattr(r, "name", None)
        status = r["status"] if isinstance(r, dict) else getattr(r, "status", None)
        if name == cluster:
            return str(getattr(status, "value", status)).upper() == "UP"
    return False


def _hourly(handle) -> float | None:
    try:
        return float(handle.launched_resources.get_cost(3600)) * max(int(handle.launched_nodes or 1), 1)
    except Exception:
        return None


def cmd_run(sky, args) -> dict:
    tee = Tee()
    task = _task(sky, args.recipe, args.env)
    try:
        if args.launch:
            req = sky.launch(task, cluster_name=args.cluster, retry_until_up=True,
                             idle_minutes_to_autostop=args.idle_minutes)
        else:
            req = sky.exec(task, cluster_name=args.cluster)
        job_id, handle = sky.stream_and_get(req, output_stream=tee)
    except (sky.exceptions.ClusterDoesNotExist, sky.exceptions.ClusterNotUpError) as e:
        return {"exit_code": None, "user_error": None, "cluster_missing": True, "error": str(e).splitlines()[0]}
    code = sky.tail_logs(args.cluster, job_id, follow=True, output_stream=tee)
    missing = code != 0 and tee.user_error is None and not _cluster_up(sky, args.cluster)
    return {"exit_code": int(code), "user_error": tee.user_error, "cluster_missing": missing,
            "hourly_usd": _hourly(handle), "job_id": job_id}


def cmd_job(sky, args) -> dict:
    tee = Tee()
    task = _task(sky, args.recipe, args.env)
    job_ids, handle = sky.stream_and_get(sky.jobs.launch(task, name=args.name), output_stream=tee)
    job_id = job_ids[0] if isinstance(job_ids, list) else job_ids
    code = sky.jobs.tail_logs(job_id=job_id, follow=True, output_stream=tee)
    return {"exit_code": int(code or 0), "user_error": tee.user_error, "cluster_missing": False,
            "hourly_usd": _hourly(handle) if handle else None, "job_id": job_id}


def cmd_down(sky, args) -> dict:
    try:
        sky.stream_and_get(sky.down(args.cluster))
    except sky.exceptions.ClusterDoesNotExist:
        pass
    return {"down": args.cluster}


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--cluster", required=True)
    run.add_argument("--launch", action="store_true")
    run.add_argument("--idle-minutes", type=int, default=10)
    job = sub.add_parser("job")
    job.add_argument("--name", required=True)
    for p in (run, job):
        p.add_argument("--recipe", required=True)
        p.add_argument("--env", action="append", default=[])
    down = sub.add_parser("down")
    down.add_argument("--cluster", required=True)
    args = ap.parse_args()

    import sky

    out = {"run": cmd_run, "job": cmd_job, "down": cmd_down}[args.cmd](sky, args)
    sys.stderr.flush()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

"""The `sky` launcher's hands on the SkyPilot SDK. Runs under the SkyPilot environment's Python (SkyPilot pins
click and uvicorn below what the rest of rlflow needs, so it lives in its own venv, `.venv-sky`), imports only
`sky`, the standard library and tasks/core/errors.py (standard library only), and answers with one JSON line
on stdout after the job's logs.

    python flows/sky_bridge.py run  --cluster C --recipe sky/train.yaml [--env K=V]... [--launch]
                                    [--idle-minutes 10] [--accelerators A100:8]
    python flows/sky_bridge.py job  --name N --recipe sky/train.yaml [--env K=V]... [--accelerators A100:8]
    python flows/sky_bridge.py serve --cluster C --recipe sky/env.yaml --port 8330 [--env K=V]... [--launch]
                                     [--wait 600] [--idle-minutes 10] [--accelerators L4:1] [--fresh]   # its URL
    python flows/sky_bridge.py down --cluster C
    python flows/sky_bridge.py price --recipe sky/train.yaml [--accelerators A100:8] [--recipe ...]   # rlflow plan

More: docs/internals.md (flows/sky_bridge.py): `--accelerators`, and what `run` reports.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path

# This checkout's `tasks` (not installed here), ahead of any other (a user's on PYTHONPATH) while it is imported,
# then off the path's front: the checkout's sky/ folder of recipes would shadow SkyPilot's `sky` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tasks.core.errors import corrupt_in, disk_full_in, user_error_in  # noqa: E402

sys.path.append(sys.path.pop(0))


class Tee(io.TextIOBase):
    """Log stream: forwards to stderr, remembers a user-error line."""

    def __init__(self):
        self.user_error = self.corrupt = self.disk_full = None
        self._buf = ""

    def write(self, s):
        sys.stderr.write(s)
        self._buf += s
        *lines, self._buf = self._buf.split("\n")
        for line in lines:
            self.user_error = user_error_in(line) or self.user_error
            self.corrupt = corrupt_in(line) or self.corrupt
            self.disk_full = disk_full_in(line) or self.disk_full
        return len(s)

    def flush(self):
        sys.stderr.flush()


def _recipe(recipe: str, accelerators: str | None = None) -> dict:
    """The recipe file as a dict; `accelerators` (e.g. "A100:8") replaces its resources.accelerators, in any
    form (and any any_of / ordered option's own, so that the one given is the only choice)."""
    import yaml

    with open(recipe) as f:
        config = yaml.safe_load(f) or {}
    if accelerators:
        res = config.setdefault("resources", {})
        res["accelerators"] = accelerators
        for option in (o for key in ("any_of", "ordered") for o in res.get(key) or [] if isinstance(o, dict)):
            option.pop("accelerators", None)
    return config


def _task(sky, recipe: str, envs: list[str], port: int | None = None, accelerators: str | None = None):
    """The recipe with the flow's envs; its secrets (null in the file) filled from this process's environment,
    as `sky launch --secret NAME` does; `port`: the one port it opens (a server's, whatever the file says);
    `accelerators`: the GPU type that replaces the recipe's (launcher.accelerators)."""
    import os

    config = _recipe(recipe, accelerators)
    if port is not None:
        config.setdefault("resources", {})["ports"] = port
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


def _submit(sky, args, task, tee):
    """The job on --cluster: launched with it (--launch) or sent to it (exec). (job_id, handle), or the answer
    for a cluster that is not there."""
    try:
        if args.launch:
            req = sky.launch(task, cluster_name=args.cluster, retry_until_up=True,
                             idle_minutes_to_autostop=args.idle_minutes)
        else:
            req = sky.exec(task, cluster_name=args.cluster)
        return sky.stream_and_get(req, output_stream=tee)
    except (sky.exceptions.ClusterDoesNotExist, sky.exceptions.ClusterNotUpError) as e:
        return {"exit_code": None, "user_error": None, "cluster_missing": True, "error": str(e).splitlines()[0]}
    except getattr(sky.exceptions, "ResourcesMismatchError", ()) as e:     # stages of one cluster asked for two GPUs
        return {"exit_code": None, "cluster_missing": False, "user_error": "launcher.accelerators: the stages sharing "
                f"cluster {args.cluster} must run on one machine: {(str(e).splitlines() or [''])[0][:300]}"}


def cmd_run(sky, args) -> dict:
    tee = Tee()
    submitted = _submit(sky, args, _task(sky, args.recipe, args.env, accelerators=args.accelerators), tee)
    if isinstance(submitted, dict):
        return submitted
    job_id, handle = submitted
    code = sky.tail_logs(args.cluster, job_id, follow=True, output_stream=tee)
    said = tee.user_error or tee.corrupt or tee.disk_full
    missing = code != 0 and said is None and not _cluster_up(sky, args.cluster)
    return {"exit_code": int(code), "user_error": tee.user_error, "corrupt": tee.corrupt, "disk_full": tee.disk_full,
            "cluster_missing": missing, "hourly_usd": _hourly(handle), "job_id": job_id}


def cmd_job(sky, args) -> dict:
    tee = Tee()
    task = _task(sky, args.recipe, args.env, accelerators=args.accelerators)
    job_ids, handle = sky.stream_and_get(sky.jobs.launch(task, name=args.name), output_stream=tee)
    job_id = job_ids[0] if isinstance(job_ids, list) else job_ids
    code = sky.jobs.tail_logs(job_id=job_id, follow=True, output_stream=tee)
    return {"exit_code": int(code or 0), "user_error": tee.user_error, "corrupt": tee.corrupt,
            "disk_full": tee.disk_full, "cluster_missing": False,
            "hourly_usd": _hourly(handle) if handle else None, "job_id": job_id}


def cmd_serve(sky, args) -> dict:
    """Start a long-lived server job (sky/env.yaml) and wait until it answers at the cluster's endpoint for
    --port: {"url": "http://ip:port"}; or, when the job ended first, its exit code and user-error line; or the
    cluster missing. The job keeps running after this returns (its own idle timeout ends it)."""
    import time
    import urllib.request

    tee = Tee()
    if args.fresh and _cluster_up(sky, args.cluster):     # (a server there that hung still holds the port)
        sky.get(sky.cancel(args.cluster, all=True))
    submitted = _submit(sky, args, _task(sky, args.recipe, args.env, port=args.port, accelerators=args.accelerators),
                        tee)
    if isinstance(submitted, dict):
        return submitted
    job_id, handle = submitted
    deadline = time.monotonic() + args.wait
    while time.monotonic() < deadline:
        try:
            found = sky.get(sky.endpoints(args.cluster, args.port)) or {}
            endpoint = found.get(args.port) or found.get(str(args.port))
        except (ValueError, RuntimeError, KeyError, sky.exceptions.ClusterNotUpError):
            endpoint = None
        if endpoint:
            url = endpoint if "://" in endpoint else f"http://{endpoint}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        return {"url": url, "job_id": job_id, "hourly_usd": _hourly(handle)}
            except (OSError, ValueError):
                pass
        status = (sky.get(sky.job_status(args.cluster, [job_id])) or {}).get(job_id)
        if status is not None and str(getattr(status, "value", status)).upper() in (
                "SUCCEEDED", "FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED"):
            code = sky.tail_logs(args.cluster, job_id, follow=False, output_stream=tee)
            return {"exit_code": int(code or 1), "user_error": tee.user_error, "cluster_missing":
                    not _cluster_up(sky, args.cluster), "error": f"the server's job ended ({status})"}
        time.sleep(1.0)
    try:
        sky.get(sky.cancel(args.cluster, job_ids=[job_id]))
    except Exception:  # noqa: BLE001 - it is reported either way
        pass
    return {"exit_code": None, "user_error": None, "cluster_missing": False,
            "error": f"the server did not answer on port {args.port} within {args.wait} s"}


def cmd_down(sky, args) -> dict:
    try:
        sky.stream_and_get(sky.down(args.cluster))
    except sky.exceptions.ClusterDoesNotExist:
        pass
    return {"down": args.cluster}


BIG_CLOUDS = ["aws", "gcp", "azure"]     # where a recipe that names no cloud is priced (`rlflow plan` says so)


def _price(recipe: str, accelerators: str | None = None) -> dict:
    """The cheapest machine SkyPilot's catalog has for a recipe's resources (its accelerators replaced by
    `accelerators` when given, as a launch would): each accelerator option (any one of `accelerators`), or the
    default instance for `cpus`/`memory`; spot or on-demand price as the recipe asks, times num_nodes
    ("hourly_usd" is the whole cluster's; "node_usd" one node's). Reads only the catalog (no credentials, no
    cluster)."""
    import math

    from sky import catalog

    config = _recipe(recipe, accelerators)
    res = config.get("resources") or {}
    spot, nodes = bool(res.get("use_spot")), int(config.get("num_nodes") or 1)
    cloud = res.get("cloud") or (str(res["infra"]).split("/")[0] if res.get("infra") else None)
    clouds = [cloud.lower()] if cloud else BIG_CLOUDS
    wanted = res.get("accelerators")
    if isinstance(wanted, str):
        name, _, count = wanted.partition(":")
        wanted = {name: float(count or 1)}
    elif isinstance(wanted, list):
        wanted = {str(a).partition(":")[0]: float(str(a).partition(":")[2] or 1) for a in wanted}
    options, failed = [], {}
    for c in clouds:                  # each cloud on its own: one cloud's catalog out of reach spoils no other
        try:
            if wanted:
                for name, count in wanted.items():
                    found = catalog.list_accelerators(gpus_only=False, name_filter=f"^{re.escape(name)}$",
                                                      quantity_filter=int(count), clouds=c, case_sensitive=False,
                                                      all_regions=False, require_price=True)
                    for infos in found.values():
                        for info in infos:
                            usd = info.spot_price if spot else info.price
                            if usd is not None and not math.isnan(usd):
                                options.append({"usd": float(usd), "what": f"{info.accelerator_name}:{count:g}",
                                                "cloud": c, "instance": info.instance_type})
            else:
                instance = catalog.get_default_instance_type(cpus=res.get("cpus"), memory=res.get("memory"),
                                                             use_spot=spot, clouds=c)
                if instance:
                    usd = catalog.get_hourly_cost(instance, use_spot=spot, region=None, zone=None, clouds=c)
                    options.append({"usd": float(usd), "what": f"cpus {res.get('cpus') or 'any'}", "cloud": c,
                                    "instance": instance})
        except Exception as e:  # noqa: BLE001 - offline catalog, unknown cloud: the plan says why, launches nothing
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            failed[c] = ("cannot download SkyPilot's catalog (no network?)" if "Connection" in type(e).__name__
                         else f"{type(e).__name__}: {first[:160]}")
    out = {"recipe": recipe, "accelerators": accelerators, "spot": spot, "nodes": nodes, "clouds": clouds,
           "failed": failed}
    if not options:
        return {**out, "hourly_usd": None, "error": _why_unpriced(clouds, failed)}
    best = min(options, key=lambda o: o["usd"])
    return {**out, "hourly_usd": best["usd"] * nodes, "node_usd": best["usd"],
            "choice": f"{best['what']} {best['cloud']} {best['instance']}",
            "error": None}


def _why_unpriced(clouds: list[str], failed: dict[str, str]) -> str:
    by_reason: dict[str, list[str]] = {}
    for c, why in failed.items():
        by_reason.setdefault(why, []).append(c)
    read = [c for c in clouds if c not in failed]
    return "; ".join(([f"no machine in the catalog of {', '.join(read)} matches"] if read else [])
                     + [f"{', '.join(cs)}: {why}" for why, cs in by_reason.items()])


def cmd_price(sky, args) -> dict:
    return {"prices": [_price(r, acc) for r, acc in args.recipe]}


class _Recipe(argparse.Action):
    """price: --recipe R [--accelerators A]: each recipe with the override that follows it (or none)."""

    def __call__(self, parser, namespace, value, option_string=None):
        recipes = list(getattr(namespace, "recipe", None) or [])
        if option_string == "--recipe":
            recipes.append((value, None))
        elif not recipes:
            parser.error("price: --accelerators goes after the --recipe it applies to")
        else:
            recipes[-1] = (recipes[-1][0], value or None)
        namespace.recipe = recipes


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run")
    run.add_argument("--cluster", required=True)
    run.add_argument("--launch", action="store_true")
    run.add_argument("--idle-minutes", type=int, default=10)
    job = sub.add_parser("job")
    job.add_argument("--name", required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--cluster", required=True)
    for p in (run, job, serve):
        p.add_argument("--recipe", required=True)
        p.add_argument("--env", action="append", default=[])
        p.add_argument("--accelerators", default=None, help="replaces the recipe's resources.accelerators")
    serve.add_argument("--port", type=int, required=True)
    serve.add_argument("--wait", type=int, default=600)
    serve.add_argument("--launch", action="store_true")
    serve.add_argument("--idle-minutes", type=int, default=10)
    serve.add_argument("--fresh", action="store_true", help="first cancel the jobs of the cluster, if it is up")
    down = sub.add_parser("down")
    down.add_argument("--cluster", required=True)
    price = sub.add_parser("price")
    price.add_argument("--recipe", action=_Recipe, required=True)
    price.add_argument("--accelerators", action=_Recipe, dest="recipe", help="for the --recipe before it")
    args = ap.parse_args()

    import sky

    out = {"run": cmd_run, "job": cmd_job, "serve": cmd_serve, "down": cmd_down,
           "price": cmd_price}[args.cmd](sky, args)
    sys.stderr.flush()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

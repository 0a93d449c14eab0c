"""`rlflow plan CONFIG`: what a run would use, printed before anything is launched or written.

For each stage: where it runs (inline, a local subprocess, a SkyPilot cluster or managed job), on what machine
(the recipe's accelerators or CPUs, nodes, spot or on-demand) and at what hourly price: SkyPilot's catalog for
`sky` stages (the cheapest machine that fits the recipe: read through flows/sky_bridge.py in SkyPilot's own
environment, no credentials needed, nothing launched), `cost.hourly_usd` for the others. Then the store, the
MLflow tracking URI and the Prefect API. It reads the config and the recipes only: no store, lease or MLflow
run is touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from flows.launch import BRIDGE, Sky, recipe_path
from tasks.core.config import STAGES
from tasks.core.processes import stream

if TYPE_CHECKING:
    from tasks.core.config import Config


def _machine(recipe: dict) -> str:
    res = recipe.get("resources") or {}
    acc = res.get("accelerators")
    if isinstance(acc, dict):
        what = " | ".join(f"{k}:{v}" for k, v in acc.items())
    elif isinstance(acc, list):
        what = " | ".join(map(str, acc))
    elif acc:
        what = str(acc)
    else:
        what = ", ".join(f"{k} {res[k]}" for k in ("cpus", "memory") if res.get(k)) or "any CPU machine"
    nodes = int(recipe.get("num_nodes") or 1)
    where = res.get("cloud") or res.get("infra")
    return what + (f" x {nodes} nodes" if nodes > 1 else "") + (f" on {where}" if where else "")


def catalog_prices(cfg: Config, recipes: list[str]) -> dict[str, dict]:
    """recipe path -> the bridge's price answer (hourly_usd, choice, error); an error for each when SkyPilot's
    environment cannot answer at all."""
    if not recipes:
        return {}
    python = Sky(cfg).python
    args = [python, str(BRIDGE), "price"] + [a for r in recipes for a in ("--recipe", r)]
    try:
        ran = stream(args, dict(os.environ), lambda _line: None)
    except OSError as e:
        return {r: {"hourly_usd": None, "error": f"cannot run SkyPilot's python {python}: {e}"} for r in recipes}
    for line in reversed(ran.last):
        if line.startswith("{"):
            try:
                return {p["recipe"]: p for p in json.loads(line)["prices"]}
            except (ValueError, KeyError):
                break
    why = (ran.last[-1].strip() if ran.last else "") or f"exit code {ran.code}"
    return {r: {"hourly_usd": None, "error": f"SkyPilot's environment ({python}) failed: {why[:200]}"}
            for r in recipes}


def plan(cfg: Config, config_path: str) -> str:
    lc = cfg.launcher
    evaluates = cfg.eval.every > 0
    stages = [s for s in STAGES if s != "evaluate" or evaluates]
    recipes = {s: str(recipe_path(cfg, s)) for s in stages if lc.mode_of(s) != "inline"}
    served = bool(cfg.env.factory) and cfg.env.where == "sky" and cfg.env.server_url is None
    env_recipe = str(recipe_path(cfg, "env")) if served else None
    prices = catalog_prices(cfg, sorted({recipes[s] for s in stages if lc.mode_of(s) == "sky"}
                                        | ({env_recipe} if served else set())))
    sky = Sky(cfg)
    rows = []
    first_on = {}                    # cluster -> the stage that launches it (the others `sky exec` on it)
    for s in stages:
        mode = lc.mode_of(s)
        engine = {"generate": f"{cfg.generate.engine} engine", "evaluate": f"{cfg.generate.engine} engine",
                  "train": f"{cfg.train.engine} engine, device {cfg.train.device}"}.get(s, "")
        if mode == "sky":
            recipe = yaml.safe_load(Path(recipes[s]).read_text()) or {}
            spot = "spot" if (recipe.get("resources") or {}).get("use_spot") else "on-demand"
            host = None if lc.managed_jobs else first_on.setdefault(sky.cluster(s), s)
            where = (f"sky managed job ({recipes[s]})" if lc.managed_jobs
                     else f"sky cluster {sky.cluster(s)} ({recipes[s]})")
            if host not in (None, s):
                machine, spot, price = f"{host}'s machine (one cluster)", "", f"- (in {host}'s)"
            else:
                machine, p = _machine(recipe), prices.get(recipes[s], {})
                if p.get("hourly_usd") is not None:
                    price = f"{p['hourly_usd']:.3f} (SkyPilot catalog: {p['choice']})"
                    if p.get("failed"):
                        price += f"; {', '.join(p['failed'])} not priced ({next(iter(p['failed'].values()))})"
                else:
                    price = f"unknown ({p.get('error')})"
        else:
            where = "inline (the flow's process)" if mode == "inline" else f"local subprocess ({recipes[s]})"
            machine, spot = "this machine", "-"
            usd = cfg.cost.hourly_usd.get(s)
            price = f"{usd:.3f} (cost.hourly_usd)" if usd is not None else "- (no cost.hourly_usd: no cost metric)"
        rows.append((s, where, machine + (f"; {engine}" if engine else ""), spot, price))
    if not evaluates:
        rows.append(("evaluate", "not run (eval.every 0)", "", "", ""))
    if cfg.env.factory and cfg.env.server_url is not None:
        rows.append(("env", f"environment server at {cfg.env.server_url} (env.server_url)", "yours", "-", "-"))
    elif cfg.env.factory and cfg.env.where == "local":
        rows.append(("env", "environment server, a process beside the flow (env.where: local)", "this machine",
                     "-", "-"))
    elif served:
        recipe = yaml.safe_load(Path(env_recipe).read_text()) or {}
        p = prices.get(env_recipe, {})
        rows.append(("env", f"environment server on sky cluster {sky.cluster('env')} ({env_recipe}), port "
                     f"{cfg.env.server_port}", _machine(recipe),
                     "spot" if (recipe.get("resources") or {}).get("use_spot") else "on-demand",
                     f"{p['hourly_usd']:.3f} (SkyPilot catalog: {p['choice']})" if p.get("hourly_usd") is not None
                     else f"unknown ({p.get('error')})"))

    tracking_from = ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") == cfg.tracking.uri
                     else "tracking.uri")
    prefect = os.environ.get("PREFECT_API_URL")
    out = [f"plan for run {cfg.run.name!r} ({config_path}): {cfg.run.iterations} iterations of "
           f"{cfg.generate.prompts_per_iteration} prompts x {cfg.generate.num_generations} completions"
           + (f", generation up to {cfg.run.max_staleness} policies behind" if cfg.run.max_staleness else ""),
           f"  store:     {cfg.store.uri.rstrip('/')}/{cfg.run.name}/"
           + (f" (endpoint {cfg.store.endpoint_url})" if cfg.store.endpoint_url else ""),
           f"  tracking:  {cfg.tracking.uri} (from {tracking_from}), experiment {cfg.tracking.experiment!r}",
           f"  prefect:   {prefect} (PREFECT_API_URL)" if prefect else
           "  prefect:   a temporary API server started by `rlflow run` (PREFECT_API_URL unset)", ""]
    head = ("stage", "runs", "machine", "spot", "USD/hour")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for r in [head, *rows]:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    return "\n".join(out)

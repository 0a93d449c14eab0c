"""`rlflow plan CONFIG`: what a run would use, printed before anything is launched or written.

For each stage: where it runs (inline, a local subprocess, a SkyPilot cluster or managed job), on what machine
and at what hourly price (SkyPilot's catalog for `sky` stages, `cost.hourly_usd` for the others). Then every
other role's machines (the generate replicas, the environment servers, the judge servers) and the total USD/hour
of everything on SkyPilot; then the store, the MLflow tracking URI and the Prefect API.

`rlflow plan` first runs the preflight `rlflow run` runs (flows/cli.py: checked_config, flows/preflight.py), so
a config run refuses is refused here with the same line and exit 2. What run does after its preflight, plan
does not: no lease, no Prefect server, no MLflow run, no cluster, nothing written to the store.
More: docs/internals.md (flows/plan.py): prices, roles and what the preflight touches, in full.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from flows.launch import BRIDGE, CLUSTER_OF, Sky, recipe_path
from tasks.core.config import STAGES
from tasks.core.placement import placement_of
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


def _recipe(path: str, accelerators: str | None) -> dict:
    """A recipe as launched: launcher.accelerators' GPU type in place of its resources.accelerators (as
    flows/sky_bridge.py does)."""
    recipe = yaml.safe_load(Path(path).read_text()) or {}
    if accelerators:
        recipe["resources"] = {**(recipe.get("resources") or {}), "accelerators": accelerators}
    return recipe


def accelerators_of(cfg: Config, stage: str) -> str | None:
    """launcher.accelerators for a stage, as Sky.run passes it: its own, else (stages sharing a cluster share
    its machine) its cluster-mate's."""
    lc = cfg.launcher
    return lc.accelerators.get(stage) or (None if lc.managed_jobs else next(
        (a for s, a in lc.accelerators.items() if CLUSTER_OF[s] == CLUSTER_OF[stage]), None))


def catalog_prices(cfg: Config, recipes: list[tuple[str, str | None]]) -> dict[tuple[str, str | None], dict]:
    """(recipe path, launcher.accelerators override or None) -> the bridge's price answer (hourly_usd for the
    whole cluster, node_usd, nodes, choice, error); an error for each when SkyPilot's environment cannot answer
    at all."""
    if not recipes:
        return {}
    python = Sky(cfg).python
    args = [python, str(BRIDGE), "price"] + [a for r, acc in recipes
                                             for a in ("--recipe", r, *(("--accelerators", acc) if acc else ()))]
    try:
        ran = stream(args, dict(os.environ), lambda _line: None)
    except OSError as e:
        return {r: {"hourly_usd": None, "error": f"cannot run SkyPilot's python {python}: {e}"} for r in recipes}
    for line in reversed(ran.last):
        if line.startswith("{"):
            try:
                return {(p["recipe"], p.get("accelerators")): p for p in json.loads(line)["prices"]}
            except (ValueError, KeyError):
                break
    why = (ran.last[-1].strip() if ran.last else "") or f"exit code {ran.code}"
    return {r: {"hourly_usd": None, "error": f"SkyPilot's environment ({python}) failed: {why[:200]}"}
            for r in recipes}


def _priced(p: dict, count: int = 1) -> tuple[str, float | None]:
    """A catalog answer as the plan prints it, for `count` such clusters: (text, USD/hour or None)."""
    if p.get("hourly_usd") is None:
        return f"unknown ({p.get('error')})", None
    usd = p["hourly_usd"] * count
    text = f"{usd:.3f} (SkyPilot catalog: {p['choice']})"
    if count > 1:
        text += f", {count} x {p['hourly_usd']:.3f}"
    if int(p.get("nodes") or 1) > 1 and p.get("node_usd") is not None:
        text += f", {p['nodes']} nodes x {p['node_usd']:.3f}"
    if p.get("failed"):
        text += f"; {', '.join(p['failed'])} not priced ({next(iter(p['failed'].values()))})"
    return text, usd


def _context(cfg: Config) -> str:
    """The model's context beside what a sequence may take (generate.max_prompt_length + max_completion_length):
    what the prompt-cut warning sends a user here for. '' where the model's config cannot be read here."""
    from tasks.core.models import base_path, engine_context

    try:
        found = engine_context(base_path(cfg))      # (what preflight's check_context weighs: the same bound)
    except Exception:  # noqa: BLE001 - a hub id not reachable from here: the plan goes on without it
        return ""
    if found is None:
        return ""
    context, key, _ = found
    gc, asked, after = cfg.generate, cfg.sequence_limit(), cfg.completion_limit()
    return (f" (context {context} tokens, {key}; a sequence up to {gc.max_prompt_length} + {after} = {asked}: "
            f"generate.max_prompt_length + {'env.max_tokens' if cfg.env.episodic() else 'max_completion_length'}"
            + (", past the context" if asked > context else "") + ")")


def plan(cfg: Config, config_path: str) -> str:
    lc, gc, place = cfg.launcher, cfg.generate, placement_of(cfg)
    n_env, n_replicas = place.env_servers, place.replicas
    evaluates = cfg.eval.every > 0
    stages = [s for s in STAGES if s != "evaluate" or evaluates]
    # where everything runs: tasks/core/placement.py (a routed stage, generate.replicas: generate and evaluate only
    # shard and route, in the flow's process; the replicas sample)
    recipes = {s: str(recipe_path(cfg, s)) for s in stages if place.launched(s)}
    on_sky = [s for s in place.on_sky() if s in stages]
    sky_replicas = place.replicas_where == "sky"
    replica_key = (str(recipe_path(cfg, "replica")), lc.accelerators.get("generate")) if sky_replicas else None
    env_key = (str(recipe_path(cfg, "env")), lc.accelerators.get("env")) if place.env == "sky" else None
    judge_key = (str(recipe_path(cfg, "judge")), lc.accelerators.get("judge")) if place.judges_at("sky") else None
    wanted = {(recipes[s], accelerators_of(cfg, s)) for s in on_sky} | {
        k for k in (replica_key, env_key, judge_key) if k}
    prices = catalog_prices(cfg, sorted(wanted, key=lambda k: (k[0], k[1] or "")))
    sky = Sky(cfg)
    rows = []
    on_sky_usd: dict[str, float | None] = {}     # role -> its machines' USD/hour (None: not priced)
    first_on = {}                    # cluster -> the stage that launches it (the others `sky exec` on it)
    engines = {"generate": f"{gc.engine} engine", "evaluate": f"{gc.engine} engine",
               "train": f"{cfg.train.engine} engine, device {cfg.train.device}"}
    for s in stages:
        mode = place.where(s)
        engine = engines.get(s, "")
        if place.routes(s):
            where = f"inline (the flow's process): routes to the {n_replicas} generate replica" + \
                ("s" if n_replicas > 1 else "")
            machine, spot, price, engine = "this machine", "-", "- (the replicas': generate replicas)", ""
        elif mode == "sky":
            key = (recipes[s], accelerators_of(cfg, s))
            recipe = _recipe(*key)
            spot = "spot" if (recipe.get("resources") or {}).get("use_spot") else "on-demand"
            host = None if lc.managed_jobs else first_on.setdefault(sky.cluster(s), s)
            where = (f"sky managed job ({recipes[s]})" if lc.managed_jobs
                     else f"sky cluster {sky.cluster(s)} ({recipes[s]})")
            if host not in (None, s):
                machine, spot, price = f"{host}'s machine (one cluster)", "", f"- (in {host}'s)"
            else:
                machine = _machine(recipe)
                price, on_sky_usd[s] = _priced(prices.get(key, {}))
        else:
            where = "inline (the flow's process)" if mode == "inline" else f"local subprocess ({recipes[s]})"
            machine, spot = "this machine", "-"
            usd = cfg.cost.hourly_usd.get(s)
            price = f"{usd:.3f} (cost.hourly_usd)" if usd is not None else "- (no cost.hourly_usd: no cost metric)"
        rows.append((s, where, machine + (f"; {engine}" if engine else ""), spot, price))
    if not evaluates:
        rows.append(("evaluate", "not run (eval.every 0)", "", "", ""))
    if sky_replicas:
        recipe = _recipe(*replica_key)
        price, on_sky_usd["generate replicas"] = _priced(prices.get(replica_key, {}), n_replicas)
        names, last = sky.cluster("replica", "0"), sky.cluster("replica", str(n_replicas - 1))
        if n_replicas > 1:                 # <cluster>-0..2, or both names where a hash ends them
            names += f"..{n_replicas - 1}" if last == f"{names[:-1]}{n_replicas - 1}" else f"..{last}"
        rows.append(("generate replicas", f"{n_replicas} sky cluster{'s' if n_replicas > 1 else ''} {names} "
                     f"({replica_key[0]})",
                     (f"{n_replicas} x " if n_replicas > 1 else "") + f"{_machine(recipe)}; {gc.engine} engine",
                     "spot" if (recipe.get("resources") or {}).get("use_spot") else "on-demand", price))
    elif place.replicas_where == "local":
        rows.append(("generate replicas", f"{n_replicas} local processes (tasks/engines/replica.py)",
                     f"this machine; {gc.engine} engine", "-", "- (this machine's)"))
    servers = f"{n_env} environment servers behind one URL" if n_env > 1 else "environment server"
    if place.env == "yours":            # (env.url read for its address only)
        rows.append(("env", f"environment server at {cfg.env.url} (env.where)", "yours", "-", "-"))
    elif place.env == "local":
        rows.append(("env", f"{servers}, {'processes' if n_env > 1 else 'a process'} beside the flow "
                     "(env.where: local)", "this machine", "-", "-"))
    elif place.env == "sky":
        recipe = _recipe(*env_key)
        price, on_sky_usd["env"] = _priced(prices.get(env_key, {}), n_env)
        rows.append(("env", f"{servers} on " + (f"{n_env} sky clusters, one each" if n_env > 1 else
                                                f"sky cluster {sky.cluster('env')}")
                     + f" ({env_key[0]}), port {cfg.env.server_port}",
                     (f"{n_env} x " if n_env > 1 else "") + _machine(recipe),
                     "spot" if (recipe.get("resources") or {}).get("use_spot") else "on-demand", price))
    for m in cfg.reward.models:        # reward models and judges: one server each, or yours, or in the stage
        what, at = f"{m.kind}" + (f" ({m.mode})" if m.kind == "judge" else ""), place.judges[m.name]
        if at == "yours":
            rows.append((f"judge {m.name}", f"{what} at {m.url} (url)", "yours", "-", "-"))
        elif at == "stage":
            rows.append((f"judge {m.name}", f"{what} in the reward/evaluate stage's process", "the stage's machine",
                         "-", "- (the stage's)"))
        elif at == "local":
            rows.append((f"judge {m.name}", f"{what}: a judge server beside the flow", f"this machine; {m.engine} "
                         f"engine", "-", "-"))
        else:
            recipe = _recipe(*judge_key)
            price, on_sky_usd[f"judge {m.name}"] = _priced(prices.get(judge_key, {}))
            rows.append((f"judge {m.name}", f"{what}: sky cluster {sky.cluster('judge', m.name)} ({judge_key[0]}), "
                         f"port {m.port}", f"{_machine(recipe)}; {m.engine} engine",
                         "spot" if (recipe.get("resources") or {}).get("use_spot") else "on-demand", price))

    tracking_from = ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") == cfg.tracking.uri
                     else "tracking.uri")
    prefect = os.environ.get("PREFECT_API_URL")
    out = [f"plan for run {cfg.run.name!r} ({config_path}): {cfg.run.iterations} iterations of "
           f"{cfg.generate.prompts_per_iteration} prompts x {cfg.generate.num_generations} completions"
           + (f", generation up to {cfg.run.max_staleness} policies behind" if cfg.run.max_staleness else ""),
           f"  store:     {cfg.store.uri.rstrip('/')}/{cfg.run.name}/"
           + (f" (endpoint {cfg.store.endpoint_url})" if cfg.store.endpoint_url else ""),
           f"  model:     {cfg.model.name_or_path}{_context(cfg)}",
           f"  tracking:  {cfg.tracking.uri} (from {tracking_from}), experiment {cfg.tracking.experiment!r}",
           f"  prefect:   {prefect} (PREFECT_API_URL)" if prefect else
           "  prefect:   a temporary API server started by `rlflow run` (PREFECT_API_URL unset)", ""]
    head = ("stage", "runs", "machine", "spot", "USD/hour")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    for r in [head, *rows]:
        out.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4])
    if on_sky_usd:
        known = sum(u for u in on_sky_usd.values() if u is not None)
        unpriced = [role for role, u in on_sky_usd.items() if u is None]
        out.append(f"  total on sky: {'at least ' if unpriced else ''}{known:.3f} USD/hour, every machine up at "
                   f"once ({', '.join(on_sky_usd)})" + (f"; not priced: {', '.join(unpriced)}" if unpriced else ""))
    return "\n".join(out)

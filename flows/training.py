"""The training loop: N iterations of generate → reward → train → publish, as a Prefect flow.

    rlflow run configs/tiny.yaml                   # the CLI calls train_flow("configs/tiny.yaml", overrides)
    prefect deployment run rlflow-train/nightly    # a deployment passes the same two parameters

Read top to bottom:
  1. the config is loaded from its path plus dotted overrides (the flow's parameters), then preflight:
     everything a user can get wrong is checked before the first byte is written (store reachable, dataset +
     prompt column, reward functions import, model folder, engines installed, launcher needs);
  2. one writer per run name: the flow takes the run's lease in the store (tasks/core/lease.py);
  3. one MLflow run per rlflow run (found again on resume);
  4. for each iteration, the stage tasks, each on its launcher (inline / local subprocess / SkyPilot,
     flows/launch.py); a stage returns at once if its output already exists in the store from the same inputs,
     so a run killed anywhere and started again ends with exactly `run.iterations` iterations, none repeated,
     none skipped. Infrastructure failures are retried with back-off; user errors fail the flow at once. A
     resident trainer in a process of its own on this machine is asked to get ready on a thread meanwhile
     (_warm_trainer). With run.max_staleness S > 0, generate and reward of the next S iterations run beside
     train as Prefect task futures (Ahead): iteration N samples from v(N-1-S), whatever the timing;
  5. every `eval.every` iterations the published policy is scored on held-out prompts (with eval.baseline the
     starting model too, first); policy/BEST and the MLflow alias `champion` follow the best of them that
     beats the starting model;
  6. metrics (with cost) of each iteration are logged once; the Prefect dashboard gets a report, a samples
     table and links per iteration (flows/dashboard.py);
  7. at the end: reward curve plot, clusters torn down, the vLLM server stopped, lease released, summary.
Stages meet only in the store; this file passes keys, never tensors.
"""

from __future__ import annotations

import os
import re
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

import torch
from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.dashboard import Progress, post_iteration, post_mlflow_link
from flows.launch import InfraError, Launchers, recipe_path, stage_env
from tasks.core import layout, retention
from tasks.core.config import Config, load_config
from tasks.core.data import load_prompts
from tasks.core.errors import UserError, cause_of
from tasks.core.lease import Lease, LeaseLost
from tasks.core.models import base_path, check_lora_targets, load_tokenizer
from tasks.core.stage import STOP
from tasks.core.store import CorruptArtifact, Store, open_store
from tasks.core.tracking import Tracker, champion_policy_uri
from tasks.engines.sampling import sampling_engine
from tasks.engines.training import training_engine
from tasks.evaluate import evaluate
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.scoring.functions import load_functions
from tasks.train import train

NOW: dict = {}      # where the flow's loop is: {"iteration", "stage"} (what an interrupted run reports)

STAGE_FUNCTIONS = {"generate": generate, "reward": reward, "train": train, "publish": publish, "evaluate": evaluate}
OUTPUT_KEY = {"generate": layout.rollouts, "reward": layout.rewards, "train": layout.checkpoint,
              "publish": layout.policy, "evaluate": layout.evaluation}


def retryable(task, task_run, state) -> bool:
    """Prefect retry condition: retry infrastructure failures, never a user's mistake or a lost lease, nor
    anything once the run was told to stop. A corrupt artifact is not retried either: Repair recomputes it."""
    exc = state.data if isinstance(state.data, BaseException) else None
    return cause_of(exc, (UserError, LeaseLost, CorruptArtifact)) is None and not STOP.is_set()


def producer_of(run: str, key: str) -> tuple[str, int] | None:
    """(stage, iteration) whose output `key` is, or None (not a stage's output: nothing can make it again)."""
    for it in {int(d) for d in re.findall(r"\d+", key[len(run):])}:
        for stage, out in OUTPUT_KEY.items():
            if it >= 1 and out(run, it) == key:
                return stage, it
    return None


class Repair:
    """The stage task, with one more way to recover: a stage that finds a committed artifact corrupt (its bytes
    changed after its manifest was written: bit rot, a bad copy, a hand edit) has that artifact quarantined
    (store.quarantine) and made again by the stage that produced it (every stage is deterministic, so it is
    the same artifact), then runs again. Said once, in one line; an artifact that cannot be made again (its
    inputs are gone, or it is corrupt again) ends the run with one line naming the file."""

    def __init__(self, stage, ctx: Run, log):
        self.stage, self.ctx, self.log = stage, ctx, log
        self.note = print            # the console line (the flow sets its progress display's)

    def __call__(self, name: str, it: int, ctx: Run, *args):
        return self._repairing(lambda: self.stage(name, it, ctx, *args), set())

    def submit(self, *args, **kwargs):
        return self.stage.submit(*args, **kwargs)

    def result(self, future, name: str, it: int, ctx: Run, *args):
        """A submitted stage's result; if it found a corrupt artifact, repaired and run again here."""
        return self._repairing(future.result, set(), again=lambda: self.stage(name, it, ctx, *args))

    def _repairing(self, call, seen: set, again=None):
        while True:
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - only a corrupt artifact is handled here
                bad = cause_of(e, CorruptArtifact)
                if bad is None:
                    raise
                self._remake(bad, seen)
                call = again or call

    def _remake(self, bad: CorruptArtifact, seen: set) -> None:
        run, store = self.ctx.cfg.run.name, self.ctx.store
        if bad.key in seen:
            raise UserError(f"{bad}: still corrupt after it was made again; the store is damaged") from None
        seen.add(bad.key)
        producer = producer_of(run, bad.key)
        moved = store.quarantine(bad.key)
        if producer is None:
            raise UserError(f"{bad}: corrupt, and no stage makes it (moved to {store.uri(moved)}); restore it "
                            f"or start a new run.name") from None
        stage, it = producer
        said = f"corrupt artifact: {bad}; moved to {store.uri(moved)}, making it again ({stage} of iteration {it})"
        self.log.warning(said)
        self.note(said)
        args = (layout.behaviour_policy(run, it, self.ctx.cfg.run.max_staleness),) if stage == "generate" else ()
        try:
            self._repairing(lambda: self.stage(stage, it, self.ctx, *args), seen)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{bad}: corrupt, and making it again failed ({str(e).splitlines()[0][:200]}); "
                            f"restore it or start a new run.name") from None


class Run:
    """What the stage tasks share within one flow run."""

    def __init__(self, cfg: Config, config_path: str, overrides: list[str], lease: Lease):
        self.cfg, self.config_path, self.overrides, self.lease = cfg, config_path, overrides, lease
        self.store = open_store(cfg)
        self.launchers = Launchers(cfg, config_path, overrides)


@task(name="stage", task_run_name="{stage}[iter {iteration}]", cache_policy=NO_CACHE)
def run_stage(stage: str, iteration: int, ctx: Run, policy: str | None = None) -> dict:
    """Run one stage where the config says; return its result (keys, metrics) read from the store."""
    if STOP.is_set():
        raise KeyboardInterrupt
    ctx.lease.check()
    cfg, log = ctx.cfg, get_run_logger()
    launcher = ctx.launchers.for_stage(stage)
    t0 = time.perf_counter()
    ran = None
    served = {}                   # env.where: local | sky: the environment server, started or checked here
    if stage in ("generate", "evaluate") and ctx.launchers.env_server is not None:
        served = ctx.launchers.env_server.env(log.info)
        if launcher is None:
            os.environ.update(served)        # (an inline stage reads them here)
    if launcher is not None:
        env = {**stage_env(ctx.config_path, ctx.overrides, iteration, policy), **served}
        ran = launcher.run(stage, iteration, env, log.info)
        key = OUTPUT_KEY[stage](cfg.run.name, iteration)
        if ctx.store.manifest(key) is None:
            raise InfraError(f"{stage}[iter {iteration}]: the {launcher.mode} job succeeded but its output "
                             f"{ctx.store.uri(key)} is missing")
    args = (policy,) if stage == "generate" else ()
    out = STAGE_FUNCTIONS[stage](cfg, iteration, *args)    # remote: finds the output and returns it
    seconds = ran.seconds if ran is not None else time.perf_counter() - t0
    hourly = ran.hourly_usd if ran is not None and ran.hourly_usd is not None else cfg.cost.hourly_usd.get(stage)
    out["metrics"] = {**out["metrics"], f"time/{stage}_seconds": seconds}
    if hourly is not None:                  # no price known: no cost metric (not a chart of zeros)
        out["metrics"][f"cost/{stage}_usd"] = seconds * hourly / 3600
    return out


def preflight(cfg: Config) -> None:
    """Raise UserError for any input mistake; writes nothing."""
    open_store(cfg).check()
    datasets = [load_prompts(cfg)] + ([load_prompts(cfg, split="eval")] if cfg.eval.every else [])
    # every split's rows reach the reward functions: only the columns all of them have count
    functions = load_functions(cfg, columns=set.intersection(*(set(ds.column_names) for ds in datasets))
                               - {cfg.data.prompt_column})
    if cfg.eval.every and cfg.eval.pass_reward is not None and cfg.eval.pass_reward not in functions.names:
        raise UserError(f"eval.pass_reward: {cfg.eval.pass_reward!r} is not one of the reward functions "
                        f"({', '.join(functions.names)})")
    if cfg.env.factory and cfg.env.where != "sky" and cfg.env.server_url is None:
        from tasks.envs.protocol import factory_of

        factory_of(cfg)                 # env.factory cannot be imported: one line, exit 2 (here, or the server)
    if cfg.env.factory and cfg.env.where == "local" and cfg.env.server_url is None and any(
            cfg.launcher.mode_of(s) == "sky" for s in ["generate"] + (["evaluate"] if cfg.eval.every else [])):
        raise UserError("env.where: local serves the environments on this machine, which the generate cluster "
                        "(launcher: sky) cannot reach; use env.where: sky, or env.server_url")
    if cfg.env.factory and cfg.env.server_url is not None:
        from tasks.envs.protocol import require_answer

        require_answer(f"{cfg.env.server_url.rstrip('/')}/health", "environment server", key="env.server_url")
    path = base_path(cfg)
    tokenizer = load_tokenizer(path)
    chat = cfg.data.system_prompt is not None or any(isinstance(ds[0][cfg.data.prompt_column], list) for ds in datasets)
    if chat and not tokenizer.chat_template:
        raise UserError(f"model.name_or_path: {path}: its tokenizer has no chat template, but the prompts are chat "
                        f"messages (data.prompt_column / data.system_prompt)")
    if cfg.launcher.mode_of("train") != "sky":
        if cfg.train.device == "cuda" and not torch.cuda.is_available():
            raise UserError("train.device: cuda, but this machine has no CUDA device (torch.cuda.is_available() "
                            "is False); use auto or cpu")
        if cfg.train.lora_r:
            check_lora_targets(cfg, path)
    if cfg.reward.sandbox.isolation == "bubblewrap" and cfg.launcher.mode_of("reward") != "sky":
        from tasks.scoring import sandbox

        sandbox.runner(cfg.reward.sandbox)     # bubblewrap asked for and not working here: one line, exit 2
    # The recipes install the engines on their clusters; a stage that runs here needs them here.
    if any(cfg.launcher.mode_of(s) != "sky" for s in ["generate"] + (["evaluate"] if cfg.eval.every else [])):
        sampling_engine(cfg).check_installed(cfg)
    if cfg.launcher.mode_of("train") != "sky":
        training_engine(cfg).check_installed(cfg)
    if cfg.train.learner.offline():
        from tasks.engines.training import offline_rollouts

        offline_rollouts(cfg, open_store(cfg))      # a key with no scored rollouts: one line, exit 2
    remote = cfg.launcher.remote_stages()
    if any(cfg.launcher.mode_of(s) == "sky" for s in remote) and not cfg.store.uri.startswith("s3://"):
        raise UserError(f"store.uri: {cfg.store.uri}: the sky launcher needs a store the clusters can reach "
                        f"(s3://...), not a local folder")
    for stage in remote:
        recipe_path(cfg, stage)
    if cfg.env.factory and cfg.env.where == "sky" and cfg.env.server_url is None:
        recipe_path(cfg, "env")


def _held_out(cfg: Config, store: Store) -> dict:
    """{"metric": eval.metric's key, "<iteration>": its value for each evaluated policy (0: the starting model)}."""
    out: dict = {"metric": cfg.eval.metric_key()}
    if cfg.eval.every:
        for it in sorted({0, *range(cfg.eval.every, cfg.run.iterations + 1, cfg.eval.every), cfg.run.iterations}):
            found = store.manifest(layout.evaluation(cfg.run.name, it))
            if found is not None and out["metric"] in found["meta"]["metrics"]:
                out[str(it)] = found["meta"]["metrics"][out["metric"]]
    return out


def _held_out_line(cfg: Config, metrics: dict) -> str:
    """An evaluation's numbers for the console: greedy pass@1 (eval.greedy), pass@k, reward."""
    shown = [("greedy", "eval/greedy_pass_at_1"), (f"pass@{cfg.eval.k}", f"eval/pass_at_{cfg.eval.k}"),
             ("reward", "eval/reward_mean")]
    return " ".join(f"{name} {metrics[key]:.3f}" for name, key in shown if key in metrics)


def _flow_run_name() -> str:
    from prefect.runtime import flow_run

    params = flow_run.parameters
    return f"{Path(params.get('config', 'run')).stem}" + (f" {' '.join(params['overrides'])}"
                                                         if params.get("overrides") else "")


@flow(name="rlflow-train", flow_run_name=_flow_run_name, log_prints=False, validate_parameters=True)
def train_flow(config: str, overrides: list[str] | None = None,
               start_from: Literal["config", "champion"] = "config",
               run_name_suffix: Literal["none", "date"] = "none") -> dict:
    """Run (or resume) a training run: `config` is a YAML path (relative to the working directory, the
    repository root), `overrides` dotted `key=value` strings. `start_from: champion` starts from the policy
    behind the registered model's `champion` alias (when there is one); `run_name_suffix: date` appends
    today's UTC date to run.name, so a nightly schedule makes one run per night."""
    log = get_run_logger()
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    if run_name_suffix == "date":
        base_name = cfg.run.name
        overrides.append(f"run.name={base_name}-{datetime.now(timezone.utc):%Y%m%d}")
        if cfg.publish.registered_model_name is None:    # all nights share one registered model (and champion)
            overrides.append(f"publish.registered_model_name={base_name}")
        cfg = load_config(config, overrides)
    if start_from == "champion" and (uri := champion_policy_uri(cfg)):
        log.info("starting from the champion policy %s", uri)
        overrides.append(f"model.name_or_path={uri}")
        cfg = load_config(config, overrides)
    preflight(cfg)
    store = open_store(cfg)
    rel = os.path.relpath(config)
    config_path = rel if not rel.startswith("..") else str(config)   # what the stage machines' workdir holds
    from prefect.runtime import flow_run

    lease = Lease(store, cfg.run.name, cfg.run.lease_seconds, flow_run_id=flow_run.id).acquire()
    _clean(cfg, store, log)                              # we are the only writer now: a crash's leftovers go
    ctx = Run(cfg, config_path, overrides, lease)
    try:
        return _iterations(ctx, log)
    finally:
        if not lease.lost:
            _finish_trainer(ctx, log)   # train.mode: resident: a full checkpoint, before any cluster goes
        ctx.launchers.close(log.info)
        sampling_engine(cfg).stop(log.info)   # generate.mode: server keeps a vLLM server alive until here
        if not lease.lost:
            try:                        # what retried train attempts of this flow run left
                _clean(cfg, store, log)
            except Exception as e:      # never hides the run's own outcome; the next flow run tries again
                log.warning("cleaning the store after the run failed: %s", e)
        lease.release()


def _finish_trainer(ctx: Run, log) -> None:
    """Stop the resident trainer after a full checkpoint of its last iteration: here (inline and local
    launchers share this machine) or on the train cluster (sky). Never raises: the run's outcome stands, and a
    trainer left behind stops itself after train.idle_timeout."""
    cfg = ctx.cfg
    if not cfg.resident_trainer:
        return
    try:
        if cfg.launcher.mode_of("train") != "sky":
            out = train(cfg, 0, finish=True)
        else:
            sky = ctx.launchers.for_stage("train")
            if sky.cluster("train") not in sky.launched:      # no train step ran on a cluster of this flow run
                return
            env = {**stage_env(ctx.config_path, ctx.overrides, 0), "FINISH": "1"}
            sky.run("train", 0, env, log.info)
            out = {"finished": "on the train cluster"}
        if out["finished"] is not None:
            log.info("resident trainer stopped after a full checkpoint of iteration %s", out["finished"])
    except Exception as e:
        log.warning("stopping the resident trainer failed: %s", e)


def _detached_trainer_here(cfg: Config) -> bool:
    """Whether the train stage's resident trainer is a process of its own on this machine (train stage local,
    or inline with deepspeed or train.host detached)."""
    if not cfg.resident_trainer:
        return False
    mode = cfg.launcher.mode_of("train")
    if mode == "local":
        return cfg.train.host != "caller"
    from tasks.engines.resident import ResidentTrainer, resident_trainer

    return mode == "inline" and isinstance(resident_trainer(cfg), ResidentTrainer)


def _warm_trainer(cfg: Config, iteration: int, log) -> None:
    """Have the detached trainer hold the state after `iteration` while generate and reward run: a new one (the
    flow's start, after a lost trainer) starts, restores and replays then, not when the train stage asks. A
    thread of the flow; never raises (the train stage does the same itself). Not for a trainer held by this
    process: it would share the process's RNG with generate at the same time."""
    from tasks.engines.resident import ResidentTrainer

    try:
        ResidentTrainer(cfg).prepare(iteration)
    except Exception as e:  # noqa: BLE001 - only an early start; the train stage reports what matters
        log.warning("warming the resident trainer up for iteration %d failed: %s", iteration + 1, e)


def _clean(cfg: Config, store: Store, log) -> None:
    """What only the lease holder may delete: half-written staging folders, orphaned engine state, and what
    store.keep does not keep (tasks/core/retention.py)."""
    if removed := store.clean_staging(cfg.run.name):
        log.info("removed %d half-written staging folder(s) left by an interrupted run", removed)
    if removed := training_engine(cfg).clean(store, cfg.run.name):
        log.info("removed %d %s checkpoint attempt(s) that no committed checkpoint names", removed, cfg.train.engine)
    try:
        champion = champion_policy_uri(cfg) if cfg.publish.register_model else None
    except Exception as e:        # without knowing the champion, no policy may go
        log.warning("retention skipped: the MLflow champion could not be read (%s)", e)
        return
    protected = {champion[len(store.root.rstrip("/")) + 1:]} if champion else set()
    if removed := retention.apply(store, cfg, protected):
        log.info("removed %d checkpoint/policy folder(s) that store.keep does not keep", removed)


class Ahead:
    """Generate and reward, run ahead of train by run.max_staleness (S) iterations. Iteration N samples from
    v(N-1-S) (tasks/core/layout.py: behaviour_policy), published by the time iteration N-S trains, so when N
    trains the stages of N+1..N+S run beside it: Prefect task futures on the flow's task runner (threads), each
    stage on its own launcher, generates one after another and rewards one after another (a lane each). Which
    policy samples an iteration never depends on timing. S = 0: plain calls when the iteration asks, as before."""

    def __init__(self, stage, ctx: Run, first: int):
        self.stage, self.ctx, self.next = stage, ctx, first
        self.S, self.last = ctx.cfg.run.max_staleness, ctx.cfg.run.iterations
        self.gen: dict = {}
        self.rew: dict = {}

    def take(self, it: int) -> tuple[dict, dict]:
        """Generate's and reward's results of iteration `it` (waiting for them), after starting those of the
        iterations up to it+S."""
        run = self.ctx.cfg.run.name
        if self.S == 0:
            NOW.update(stage="generate")
            g = self.stage("generate", it, self.ctx, layout.behaviour_policy(run, it, 0))
            NOW.update(stage="reward")
            return g, self.stage("reward", it, self.ctx)
        while self.next <= min(it + self.S, self.last):
            m = self.next
            self.gen[m] = self.stage.submit("generate", m, self.ctx, layout.behaviour_policy(run, m, self.S),
                                            wait_for=[self.gen[m - 1]] if m - 1 in self.gen else None)
            self.rew[m] = self.stage.submit("reward", m, self.ctx,
                                            wait_for=[self.gen[m]] + ([self.rew[m - 1]] if m - 1 in self.rew else []))
            self.next += 1
        policy = layout.behaviour_policy(run, it, self.S)       # (later ones wait for it+1.. only)
        return (self.stage.result(self.gen.pop(it), "generate", it, self.ctx, policy),
                self.stage.result(self.rew.pop(it), "reward", it, self.ctx))

    def drain(self) -> None:
        """Wait for every stage still running (a failed iteration's neighbours): retried or failed, they end."""
        for future in [*self.gen.values(), *self.rew.values()]:
            try:
                future.wait()
            except BaseException:   # noqa: BLE001 - the error that ended the flow is the one to report
                pass


def _iterations(ctx: Run, log) -> dict:
    cfg, store = ctx.cfg, ctx.store
    tracker = Tracker(cfg, store.root)
    run_id = tracker.start()
    already_logged = tracker.last_logged_iteration()
    cost_so_far = tracker.last_value("cost_usd")
    mlflow_url = tracker.run_url()
    post_mlflow_link(cfg, mlflow_url)
    log.info("run %s: store %s, MLflow run %s", cfg.run.name, store.uri(cfg.run.name), run_id)
    stage = Repair(run_stage.with_options(retries=cfg.launcher.retries, retry_condition_fn=retryable,
                                          retry_delay_seconds=exponential_backoff(cfg.launcher.retry_backoff_seconds)
                                          if cfg.launcher.retry_backoff_seconds else 0), ctx, log)

    reward_means: list[float] = []
    published = None
    # Iterations before the newest published one that MLflow has too are done: not walked again (their older
    # checkpoints may be gone, store.keep), only their rewards read back for the curve.
    latest = store.get_pointer(layout.latest(cfg.run.name, "policy"))
    newest = layout.version_of(latest) if latest else 0
    done = min(newest - 1, already_logged, cfg.run.iterations - 1) if latest else 0
    progress = Progress(cfg.run.iterations, already_logged)
    stage.note = progress.note
    if newest >= cfg.run.iterations and already_logged >= cfg.run.iterations:
        progress.note(f"{cfg.run.name} is already complete ({cfg.run.iterations} iterations in "
                      f"{store.uri(cfg.run.name)}); checking its last iteration and ending it")
    elif latest or already_logged:
        progress.note(f"resuming {cfg.run.name}: iterations 1-{min(newest, already_logged)} of "
                      f"{cfg.run.iterations} found in {store.uri(cfg.run.name)}")
    ahead = Ahead(stage, ctx, first=done + 1)
    try:
        if cfg.eval.every and cfg.eval.baseline:
            NOW.update(iteration=0, stage="evaluate")
            e = stage("evaluate", 0, ctx)       # (stored once: a resumed run reads it back)
            tracker.floor = e["metrics"][cfg.eval.metric_key()]
            if already_logged == 0:
                tracker.log_iteration(0, e["metrics"])
            progress.note(f"base model: held-out {_held_out_line(cfg, e['metrics'])}")
        for it in range(1, done + 1):
            reward_means.append(store.manifest(layout.rewards(cfg.run.name, it))["meta"]["metrics"]["reward/mean"])
        warm = _detached_trainer_here(cfg)
        for it in range(done + 1, cfg.run.iterations + 1):
            t0 = time.perf_counter()
            if warm:
                threading.Thread(target=_warm_trainer, args=(cfg, it - 1, log), name="rlflow-warm-trainer",
                                 daemon=True).start()
            NOW.update(iteration=it, stage="generate/reward")
            g, r = ahead.take(it)       # (S > 0: generate and reward of it+1..it+S start now, beside train(it))
            NOW.update(stage="train")
            t = stage("train", it, ctx)
            NOW.update(stage="publish")
            p = stage("publish", it, ctx)
            published = p
            e = {"metrics": {}}
            if cfg.eval.every and (it % cfg.eval.every == 0 or it == cfg.run.iterations):
                NOW.update(stage="evaluate")
                e = stage("evaluate", it, ctx)
            reward_means.append(r["metrics"]["reward/mean"])
            if it > already_logged:
                metrics = {**g["metrics"], **r["metrics"], **t["metrics"], **p["metrics"], **e["metrics"],
                           "iteration/seconds": time.perf_counter() - t0}
                costs = [v for k, v in metrics.items() if k.startswith("cost/") and k.endswith("_usd")]
                if costs:                   # (some stage's price is known)
                    metrics["cost/iteration_usd"] = sum(costs)
                    cost_so_far += metrics["cost/iteration_usd"]
                    metrics["cost_usd"] = cost_so_far
                tracker.log_iteration(it, metrics, r["samples"], policy_uri=p["uri"])
                every = cfg.tracking.dashboard_every
                if (every and it % every == 0) or it == cfg.run.iterations:
                    post_iteration(cfg, it, metrics, r["samples"], p["uri"])
                failed = sum(v for k, v in r["metrics"].items() if k.startswith("reward/") and k.endswith("/errors"))
                progress.line(f"iter {it:>4}/{cfg.run.iterations}  reward {r['metrics']['reward/mean']:.3f}  "
                              f"loss {t['metrics']['train/loss']:+.4f}  {time.perf_counter() - t0:5.2f}s"
                              + (f"  reward errors {failed:g}" if failed else "")
                              + (f"  held-out {_held_out_line(cfg, e['metrics'])}" if e["metrics"] else ""))
                log.info("iteration %d: reward %.3f loss %.4f", it, r["metrics"]["reward/mean"],
                         t["metrics"]["train/loss"])
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):   # (a stop signal: the process ends now, its threads with it)
            ahead.drain()          # nothing of this flow run writes once it has ended (and its lease gone)
        # keeps what was logged; never masks the error that got us here; a refusal (the user's input) leaves a
        # finished earlier run finished
        tracker.finish("FAILED", refused=cause_of(e, UserError) is not None)
        raise
    finally:
        progress.close()
    tracker.drain()
    curve = tracker.log_reward_curve(reward_means, Path("rlflow-runs") / cfg.run.name)
    tracker.finish()
    return {
        "run": cfg.run.name,
        "iterations_completed": len(reward_means),
        "reward_mean": reward_means,
        "policy_uri": published["uri"],
        "mlflow_run_id": run_id,
        "mlflow": mlflow_url,
        "model_version": tracker.model_version(published["uri"]),
        "best_policy": store.get_pointer(layout.best(cfg.run.name)),
        "held_out": _held_out(cfg, store),
        "champion": champion_policy_uri(cfg) if cfg.publish.register_model else None,
        "cost_usd": cost_so_far,
        "reward_curve": str(curve.absolute()),
    }

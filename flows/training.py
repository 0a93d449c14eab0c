"""The training loop: N iterations of generate → reward → train → publish, as a Prefect flow.

    rlflow run configs/tiny.yaml                   # the CLI calls train_flow("configs/tiny.yaml", overrides)
    prefect deployment run rlflow-train/nightly    # a deployment passes the same two parameters

In order: the config and its preflight (flows/preflight.py); the run's lease (tasks/core/lease.py); one MLflow
run per rlflow run; for each iteration the stage tasks, each on its launcher (flows/launch.py), a stage
returning at once when its output already exists from the same inputs, failures retried or repaired
(flows/repair.py), later iterations' generate and reward beside train with run.max_staleness
(flows/schedule.py); every `eval.every` iterations the held-out evaluation, policy/BEST and the MLflow alias
`champion`; metrics and the dashboard (flows/dashboard.py); at the end the reward curve, the teardown, the
lease released and the summary.
Stages meet only in the store; this file passes keys, never tensors.
More: docs/internals.md (flows/training.py): each step, in full.
"""

from __future__ import annotations

import math
import os
import re
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.dashboard import Progress, Report
from flows.launch import InfraError, stage_env
from flows.preflight import preflight
from flows.repair import Repair, output_key, retryable
from flows.schedule import Ahead
from flows.services import Launchers
from flows.warmup import warm_start
from tasks.core import layout, retention
from tasks.core.config import Config, load_config
from tasks.core.errors import UserError, cause_of
from tasks.core.lease import Lease
from tasks.core.placement import placement_of
from tasks.core.registry import champion_policy_uri
from tasks.core.stage import STOP
from tasks.core.store import CorruptArtifact, Store, open_store
from tasks.core.tracking import Tracker
from tasks.engines.detached import DetachedTrainer
from tasks.engines.sampling import sampling_engine
from tasks.engines.streaming import Stream
from tasks.engines.training import training_engine
from tasks.envs.runtime import screens
from tasks.envs.runtime.episodes import EnvironmentsStalled
from tasks.evaluate import evaluate
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import finish_trainer, open_trainer, train

NOW: dict = {}      # where the flow's loop is: {"iteration", "stage"} (what an interrupted run reports)

STAGE_FUNCTIONS = {"generate": generate, "reward": reward, "train": train, "publish": publish, "evaluate": evaluate}
SERVED_STAGES = ("generate", "reward", "evaluate")      # the stages that take a context (Services)


class FlowRun:
    """What the stage tasks share within one flow run."""

    def __init__(self, cfg: Config, config_path: str, overrides: list[str], lease: Lease):
        self.cfg, self.config_path, self.overrides, self.lease = cfg, config_path, overrides, lease
        self.store = open_store(cfg)
        self.launchers = Launchers(cfg, config_path, overrides)


def _stage_run_name() -> str:
    """generate[iter 3], or generate[iter 3 round 1] for dynamic sampling's later rounds."""
    from prefect.runtime import task_run

    p = task_run.parameters
    return f"{p['stage']}[iter {p['iteration']}" + (f" round {p['round']}" if p.get("round") else "") + "]"


@task(name="stage", task_run_name=_stage_run_name, cache_policy=NO_CACHE)
def run_stage(stage: str, iteration: int, ctx: FlowRun, policy: str | None = None, round: int = 0) -> dict:
    """Run one stage where the config says (`round`: dynamic sampling's, generate and reward); return its result
    (keys, metrics) read from the store."""
    if STOP.is_set():
        raise KeyboardInterrupt
    ctx.lease.check()
    cfg, log = ctx.cfg, get_run_logger()
    launcher = ctx.launchers.for_stage(stage)
    t0 = time.perf_counter()
    ran = None
    # the stage's context: its servers (the environment server, judges: started or checked here) and how its router
    # launches replicas on sky; an inline stage gets it as an argument, a stage process as variables
    services = ctx.launchers.services(stage, log.info)
    if launcher is not None:
        env = {**stage_env(ctx.config_path, ctx.overrides, iteration, policy, round), **services.variables()}
        ran = launcher.run(stage, iteration, env, log.info)
        key = output_key(cfg, stage, iteration, round)
        if ctx.store.manifest(key) is None:
            raise InfraError(f"{stage}[iter {iteration}]: the {launcher.mode} job succeeded but its output "
                             f"{ctx.store.uri(key)} is missing")
    args = (policy,) if stage == "generate" else ()
    kwargs = {"round": round} if round else {}
    if stage in SERVED_STAGES:
        kwargs["services"] = services
    try:
        out = STAGE_FUNCTIONS[stage](cfg, iteration, *args, **kwargs)    # remote: finds the output and returns it
    except EnvironmentsStalled:          # (an infrastructure fault: retried; a stalled server is started again)
        if ctx.launchers.env_server is not None:
            ctx.launchers.env_server.stalled = True
        raise
    seconds = ran.seconds if ran is not None else time.perf_counter() - t0
    hourly = ran.hourly_usd if ran is not None and ran.hourly_usd is not None else cfg.cost.hourly_usd.get(stage)
    out["metrics"] = {**out["metrics"], f"time/{stage}_seconds": seconds}
    if hourly is not None:                  # no price known: no cost metric (not a chart of zeros)
        out["metrics"][f"cost/{stage}_usd"] = seconds * hourly / 3600
    return out


def shown(reward: float) -> str:
    """A mean reward as the console says it: NaN (a batch nothing scored: its step skipped) as "n/a"."""
    return f"{reward:.3f}" if math.isfinite(reward) else "  n/a"


class ConsoleWarnings:
    """What the console warns about as iterations go (each said once, not every iteration): the trainer and the
    sampler disagreeing about the policy (train/mismatch_kl above train.mismatch_kl_warn, or 10x above its median
    so far: a policy that never reached the sampler; only where the samples are of the policy trained,
    generate/staleness 0), and dynamic sampling finding no group with a signal."""

    def __init__(self, cfg: Config, note, log):
        self.cfg, self.note, self.log = cfg, note, log
        self.kl: list[float] = []
        self.warned: set[str] = set()
        self.replicas_lost = 0          # the router's count of lost replicas at the last line about them

    def iteration(self, it: int, reward: dict, train: dict, generate: dict | None = None) -> None:
        kl = train.get("train/mismatch_kl")
        if kl is not None and not (generate or {}).get("generate/staleness"):  # (stale: the KL holds the updates
            # since the sampler's policy too; every run.max_staleness run was warned of at its iteration S+1)
            limit = self.cfg.train.mismatch_kl_warn
            median = sorted(self.kl)[len(self.kl) // 2] if self.kl else None
            jumped = median is not None and kl > max(10 * median, 1e-4)
            finite = math.isfinite(kl)              # (NaN compares False with both limits: said as what it is)
            if not finite or kl > limit or jumped:
                self._say("mismatch", f"warning: iteration {it}: train/mismatch_kl {kl:.2e} "
                          + ("is not a number (a behaviour logprob of -inf, or the trainer's NaN)" if not finite else
                             f"is above train.mismatch_kl_warn ({limit:g})" if kl > limit else
                             f"jumped from a median of {median:.2e}")
                          + ": the sampler's logprobs disagree with the trainer's (a policy that did not reach the "
                          "sampler, an engine sampling other weights; docs/operations.md); said once")
            if finite:
                self.kl.append(kl)
        if reward.get("dynamic/groups_kept") == 0:
            ds = self.cfg.generate.dynamic_sampling
            self._say("constant", f"warning: iteration {it}: every group was constant through "
                      f"generate.dynamic_sampling.max_rounds ({ds.max_rounds} rounds): trained without a learning "
                      f"signal (dynamic/short counts such iterations' missing groups); said once")

    def replicas(self, it: int, generate: dict) -> None:
        """Generate replicas the router lost (and replaced) since the last such line: said each time. (The count
        is the router's since it started: a new router, after a resume, counts from 0 again.)"""
        if (total := generate.get("generate/router/lost")) is None:
            return
        lost = int(total) - self.replicas_lost if total >= self.replicas_lost else int(total)   # (a new router)
        if lost > 0:
            from tasks.engines.replicas import router_log

            self.note(f"iteration {it}: {lost} generate replica{'s' * (lost > 1)} lost, replaced by the router "
                      f"(why, and the new one's start: {router_log(self.cfg)})")
        self.replicas_lost = int(total)

    def _say(self, what: str, line: str) -> None:
        if what not in self.warned:
            self.warned.add(what)
            self.log.warning(line)
            self.note(line)


def _held_out(cfg: Config, store: Store) -> dict:
    """{"metric": eval.metric's key, "<iteration>": its value for each evaluated policy (0: the starting model)}."""
    out: dict = {"metric": cfg.eval.metric_key()}
    if cfg.eval.every:
        for it in sorted({0, *range(cfg.eval.every, cfg.run.iterations + 1, cfg.eval.every), cfg.run.iterations}):
            found = store.manifest(layout.evaluation(cfg.run.name, it))
            if found is not None and out["metric"] in found["meta"]["metrics"]:
                out[str(it)] = found["meta"]["metrics"][out["metric"]]
    return out


def eval_label(cfg: Config) -> str:
    """What the console calls the evaluation: held-out, or train-set where its prompts are the training ones
    (Config.eval_is_held_out: the tiny demo's, which has no unseen letters to hold out)."""
    return "held-out" if cfg.eval_is_held_out() else "train-set"


def _held_out_line(cfg: Config, metrics: dict) -> str:
    """An evaluation's numbers for the console: greedy pass@1 (eval.greedy), pass@k, reward."""
    shown = [("greedy", "eval/greedy_pass_at_1"), ("format", "eval/greedy_format_share"),
             (f"pass@{cfg.eval.k}", f"eval/pass_at_{cfg.eval.k}"), ("reward", "eval/reward_mean")]
    line = " ".join(f"{name} {metrics[key]:.3f}" for name, key in shown if key in metrics)
    return line or ("not scored (every reward call failed: eval/unscored_passes; the stage's log says why)"
                    if "eval/unscored_passes" in metrics else line)


# The names Prefect makes up for a flow run: two words of letters joined by a dash (`sleek-bison` from the server,
# `Sleek-Bison` suggested by the dashboard's run form). Only those are replaced by the run's name.
PREFECT_MADE_NAME = re.compile(r"[a-z]+-[a-z]+|[A-Z][a-z]*-[A-Z][A-Za-z ]*")


def _run_name(name: str, suffix: str) -> str:
    """run.name as this flow run uses it: with run_name_suffix `date`, today's UTC date appended."""
    return f"{name}-{datetime.now(timezone.utc):%Y%m%d}" if suffix == "date" else name


def _flow_run_name() -> str:
    """The flow run is named after the rlflow run (run.name, dated under run_name_suffix: date) whichever way it
    started (`rlflow run`, a deployment, its schedule), unless it was given a name of its own when it was made."""
    from prefect.runtime import flow_run

    if flow_run.name and not PREFECT_MADE_NAME.fullmatch(flow_run.name):
        return flow_run.name
    params = flow_run.parameters
    try:
        cfg = load_config(params["config"], list(params.get("overrides") or []))
    except Exception:  # noqa: BLE001 - the flow itself refuses the config, with the line that says why
        return Path(str(params.get("config", "run"))).stem
    return _run_name(cfg.run.name, params.get("run_name_suffix", "none"))


@flow(name="rlflow-train", flow_run_name=_flow_run_name, log_prints=False, validate_parameters=True)
def train_flow(config: str, overrides: list[str] | None = None,
               start_from: Literal["config", "champion"] = "config",
               run_name_suffix: Literal["none", "date"] = "none") -> dict:
    """Run (or resume) a training run: `config` is a YAML path (relative to the working directory, the
    repository root), `overrides` dotted `key=value` strings. `start_from: champion` starts from the policy
    behind the registered model's `champion` alias (when there is one); `run_name_suffix: date` appends
    today's UTC date to run.name, so a nightly schedule makes one run per night."""
    return _train_flow(config, overrides, start_from, run_name_suffix)


def _train_flow(config: str, overrides: list[str] | None, start_from: str, run_name_suffix: str) -> dict:
    log = get_run_logger()
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    if run_name_suffix == "date":
        base_name = cfg.run.name
        overrides.append(f"run.name={_run_name(base_name, run_name_suffix)}")
        if cfg.publish.registered_model_name is None:    # all nights share one registered model (and champion)
            overrides.append(f"publish.registered_model_name={base_name}")
        cfg = load_config(config, overrides)
    if start_from == "champion" and (uri := champion_policy_uri(cfg)):
        log.info("starting from the champion policy %s", uri)
        overrides.append(f"model.name_or_path={uri}")
        if cfg.warmup is not None:          # (the champion was warm-started already)
            log.info("warmup: skipped, the champion is the starting policy")
            overrides.append("warmup=null")
        cfg = load_config(config, overrides)
    preflight(cfg)
    store = open_store(cfg)
    rel = os.path.relpath(config)
    config_path = rel if not rel.startswith("..") else str(config)   # what the stage machines' workdir holds
    from prefect.runtime import flow_run

    lease = Lease(store, cfg.run.name, cfg.run.lease_seconds, flow_run_id=flow_run.id).acquire()
    try:
        _clean(cfg, store, log)                          # we are the only writer now: a crash's leftovers go
        if cfg.warmup is not None:      # SFT first, once (flows/warmup.py): every stage then starts from its v0
            overrides += warm_start(cfg, log)
            cfg = load_config(config, overrides)
    except BaseException:
        lease.release()
        raise
    ctx = FlowRun(cfg, config_path, overrides, lease)
    try:
        return _iterations(ctx, log)
    finally:
        if dropped := Stream.stop_run(cfg.run.name):   # generate.streaming: its sampler first (it keeps sampling)
            log.info(f"generate.streaming: the sampler stopped with {dropped} tokens of unfinished rows; their "
                     f"groups are sampled again from their prompts when the run resumes")
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


def _finish_trainer(ctx: FlowRun, log) -> None:
    """Finish the resident trainer: a full checkpoint of its last iteration, then it stops; here (inline and local
    launchers share this machine: tasks/train.py's finish_trainer) or on the train cluster (sky: `python -m
    tasks.train finish` there). Never raises: the run's outcome stands, and a trainer left behind stops itself
    after train.idle_timeout."""
    cfg = ctx.cfg
    if not cfg.resident_trainer:
        return
    try:
        if ctx.launchers.placement.where("train") != "sky":
            finished = finish_trainer(cfg)
        else:
            sky = ctx.launchers.for_stage("train")
            if sky.cluster("train") not in sky.launched:      # no train step ran on a cluster of this flow run
                return
            env = {**stage_env(ctx.config_path, ctx.overrides, 0), "FINISH": "1"}
            sky.run("train", 0, env, log.info)
            finished = "on the train cluster"
        if finished is not None:
            log.info("resident trainer stopped after a full checkpoint of iteration %s", finished)
    except Exception as e:
        log.warning("stopping the resident trainer failed: %s", e)


def _trainer_to_warm(cfg: Config) -> DetachedTrainer | None:
    """The flow's handle on the train stage's resident trainer when that is a process of its own on this machine
    (train stage local, or inline with deepspeed or train.host detached); None otherwise."""
    if not cfg.resident_trainer:
        return None
    mode = placement_of(cfg).where("train")
    if mode == "local":
        return DetachedTrainer(cfg) if cfg.train.host != "caller" else None
    trainer = open_trainer(cfg) if mode == "inline" else None
    return trainer if isinstance(trainer, DetachedTrainer) else None


def _warm_trainer(trainer: DetachedTrainer, iteration: int, log) -> None:
    """Have the detached trainer hold the state after `iteration` while generate and reward run: a new one (the
    flow's start, after a lost trainer) starts, restores and replays then, not when the train stage asks. A
    thread of the flow; never raises (the train stage does the same itself). Not for a trainer held by this
    process: it would share the process's RNG with generate at the same time."""
    try:
        trainer.preload(iteration)
    except Exception as e:  # noqa: BLE001 - only an early start; the train stage reports what matters
        log.warning("warming the resident trainer up for iteration %d failed: %s", iteration + 1, e)


def _clean(cfg: Config, store: Store, log) -> None:
    """What only the lease holder may delete: half-written staging folders, orphaned engine state, and what
    store.keep does not keep (tasks/core/retention.py)."""
    if removed := store.clean_staging(cfg.run.name):
        log.info("removed %d half-written staging folder(s) or file(s) left by an interrupted run", removed)
    if removed := training_engine(cfg).clean(store, cfg.run.name):
        log.info("removed %d %s checkpoint attempt(s) that no committed checkpoint names", removed, cfg.train.engine)
    try:
        champion = champion_policy_uri(cfg) if cfg.publish.register_model else None
    except Exception as e:        # without knowing the champion, no policy may go
        log.warning("retention skipped: the MLflow champion could not be read (%s)", e)
        return
    protected = {champion[len(store.root.rstrip("/")) + 1:]} if champion else set()
    for said in retention.mend_pointers(store, cfg):
        log.warning(said)
        print(f"pointer mended: {said}", file=sys.stderr, flush=True)    # (the console shows no log warnings)
    try:
        removed = retention.apply(store, cfg, protected)
    except CorruptArtifact as e:   # (nothing deleted: the stage that reads it has it made again, flows/repair.py)
        log.warning("retention skipped: %s", e)
        return
    if removed:
        log.info("removed %d checkpoint/policy folder(s) that store.keep does not keep", removed)


def _walkable(cfg: Config, store: Store, done: int, newest: int) -> int:
    """The iteration a resume walks again after: `done` (MLflow's last), or a later one where train could not run
    again from it. Train k+1 needs ckpt-k, or takes ckpt-(k+1) as it is (tasks/train.py: _outlived_its_input); but
    store.keep keeps the newest checkpoints only, and MLflow lags the store by more than those where a kill came
    right after the last publish: the run could never resume (train 10 wanted ckpt-9, both gone)."""
    run = cfg.run.name
    while 0 < done < min(newest, cfg.run.iterations) - 1 and store.manifest(layout.checkpoint(run, done)) is None \
            and store.manifest(layout.checkpoint(run, done + 1)) is None \
            and store.manifest(layout.rewards(run, done + 1)) is not None:       # (what it is logged from)
        done += 1
    return done


def _log_stored(cfg: Config, store: Store, tracker: Tracker, first: int, last: int) -> None:
    """Iterations first..last, done but not in MLflow and not walked again (_walkable), logged from what the
    store keeps of them: their rollouts', rewards' and policy's metrics (their checkpoints', the train metrics, are
    gone)."""
    run = cfg.run.name
    for it in range(first, last + 1):
        metrics: dict[str, float] = {}
        for key in (layout.rollouts(run, it, 0), layout.rewards(run, it), layout.policy(run, it)):
            metrics.update((store.manifest(key) or {}).get("meta", {}).get("metrics", {}))
        tracker.log_iteration(it, metrics)


def _eval_traces(cfg, iteration: int) -> list[tuple[str, str]]:
    """The evaluate stage's records of policy v`iteration` to log as traces: sampled and greedy."""
    key = layout.evaluation(cfg.run.name, iteration)
    return [("eval", key), *([("eval-greedy", key)] if cfg.eval.greedy else [])]


def _pictures(cfg: Config, store: Store, report: Report, iteration: int, metrics: dict) -> list[tuple[Path, str]]:
    """An evaluation that pictured its episodes (eval.screenshots): the first strips to the Prefect report; returns
    the folder whose every frame goes to MLflow with the iteration (artifacts screens/vN)."""
    if not metrics.get("eval/screens_episodes"):
        return []
    folder = store.local(layout.evaluation(cfg.run.name, iteration))
    report.picture(iteration, folder / screens.FOLDER, screens.load_index(folder))
    return [(folder / screens.FOLDER, f"screens/v{iteration:06d}")]


def _stored_through(cfg: Config, store: Store, done: int) -> int:
    """The last iteration after `done` whose rollouts or checkpoint an earlier attempt of the run stored (`done`:
    none), counting on while they follow one another."""
    run, it = cfg.run.name, done
    while it < cfg.run.iterations and any(store.manifest(key) is not None for key in (
            layout.rollouts(run, it + 1), layout.checkpoint(run, it + 1))):
        it += 1
    return it


def _iterations(ctx: FlowRun, log) -> dict:
    cfg, store = ctx.cfg, ctx.store
    tracker = Tracker(cfg, store.root)
    run_id = tracker.start(store)
    already_logged = tracker.last_logged_iteration()
    cost_so_far = tracker.last_value("cost_usd")
    links = tracker.links()
    report = Report(cfg, links, store.uri(cfg.run.name))
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
    stage.note = ctx.launchers.note = progress.note
    if (walkable := _walkable(cfg, store, done, newest)) > done:
        _log_stored(cfg, store, tracker, done + 1, walkable)
        progress.note(f"iterations {done + 1}-{walkable}: logged to MLflow from the store (the run was stopped "
                      f"before MLflow had them, and store.keep has removed their checkpoints: no train metrics)")
        done = walkable
    if tracker.superseded:
        progress.note(tracker.superseded)
    if newest >= cfg.run.iterations and already_logged >= cfg.run.iterations:
        progress.note(f"{cfg.run.name} is already complete ({cfg.run.iterations} iterations in "
                      f"{store.uri(cfg.run.name)}); checking its last iteration and ending it")
    elif newest:                   # (what the store holds: MLflow may not have the last one, killed before it)
        progress.note(f"resuming {cfg.run.name}: iterations 1-{min(newest, cfg.run.iterations)} of "
                      f"{cfg.run.iterations} found in {store.uri(cfg.run.name)}")
    ahead = Ahead(stage, ctx, first=done + 1, now=NOW, stored=_stored_through(cfg, store, done))
    try:
        if cfg.eval.every and cfg.eval.baseline:
            NOW.update(iteration=0, stage="evaluate")
            e = stage("evaluate", 0, ctx)       # (stored once: a resumed run reads it back)
            tracker.floor = e["metrics"][cfg.eval.metric_key()]
            if already_logged == 0:
                tracker.log_iteration(0, e["metrics"], traces=_eval_traces(cfg, 0),
                                      folders=_pictures(cfg, store, report, 0, e["metrics"]))
            first = "starting policy" if str(cfg.model.name_or_path).startswith(("s3://", "file://")) else \
                "base model"            # (a warm start's v0 or the champion is no base model)
            progress.note(f"{first}: {eval_label(cfg)} {_held_out_line(cfg, e['metrics'])}")
        for it in range(1, done + 1):
            reward_means.append(store.manifest(layout.rewards(cfg.run.name, it))["meta"]["metrics"]["reward/mean"])
            report.record(it, {"reward/mean": reward_means[-1]})
        warm = _trainer_to_warm(cfg)
        watch = ConsoleWarnings(cfg, progress.note, log)
        for it in range(done + 1, cfg.run.iterations + 1):
            t0 = time.perf_counter()
            if warm is not None:
                threading.Thread(target=_warm_trainer, args=(warm, it - 1, log), name="rlflow-warm-trainer",
                                 daemon=True).start()
            NOW.update(iteration=it, stage="generate/reward")
            g, r = ahead.take(it)       # (S > 0: generate and reward of it+1..it+S start now, beside train(it))
            watch.replicas(it, g["metrics"])
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
            watch.iteration(it, r["metrics"], t["metrics"], g["metrics"])
            report.record(it, {**r["metrics"], **t["metrics"], **e["metrics"]})
            if it > already_logged:
                metrics = {**g["metrics"], **r["metrics"], **t["metrics"], **p["metrics"], **e["metrics"],
                           "iteration/seconds": time.perf_counter() - t0}
                costs = [v for k, v in metrics.items() if k.startswith("cost/") and k.endswith("_usd")]
                if costs:                   # (some stage's price is known)
                    metrics["cost/iteration_usd"] = sum(costs)
                    cost_so_far += metrics["cost/iteration_usd"]
                    metrics["cost_usd"] = cost_so_far
                tracker.log_iteration(it, metrics, r["samples"], policy_uri=p["uri"],
                                      traces=[("train", layout.rewards(cfg.run.name, it)),
                                              *(_eval_traces(cfg, it) if e["metrics"] else [])],
                                      folders=_pictures(cfg, store, report, it, e["metrics"]))
                every = cfg.tracking.dashboard_every
                if (every and it % every == 0) or it == cfg.run.iterations:
                    report.post(it, metrics, r["samples"], p["uri"])
                failed = sum(v for k, v in r["metrics"].items() if k.startswith("reward/") and k.endswith("/errors"))
                progress.line(f"iter {it:>4}/{cfg.run.iterations}  reward {shown(r['metrics']['reward/mean'])}  "
                              f"loss {t['metrics']['train/loss']:+.4f}  {time.perf_counter() - t0:5.2f}s"
                              + (f"  reward errors {failed:g}" if failed else "")
                              + (f"  {eval_label(cfg)} {_held_out_line(cfg, e['metrics'])}" if e["metrics"] else ""))
                log.info("iteration %d: reward %.3f loss %.4f", it, r["metrics"]["reward/mean"],
                         t["metrics"]["train/loss"])
    except BaseException as e:
        if not isinstance(e, KeyboardInterrupt):   # (a stop signal: the process ends now, its threads with it)
            ahead.drain()          # nothing of this flow run writes once it has ended (and its lease gone)
        # keeps what was logged; never masks the error that got us here; a refusal (the user's input) leaves a
        # finished earlier run finished
        tracker.end("FAILED", refused=cause_of(e, UserError) is not None)
        raise
    finally:
        progress.close()
    if report.posted != cfg.run.iterations:     # (a complete run checked again: its report shows its end too)
        report.post(cfg.run.iterations, {**g["metrics"], **r["metrics"], **t["metrics"], **p["metrics"],
                                         **e["metrics"]}, r["samples"], p["uri"])
    tracker.drain()
    curve = tracker.log_reward_curve(reward_means, Path("rlflow-runs") / cfg.run.name)
    tracker.end()
    return {
        "run": cfg.run.name,
        "iterations_completed": len(reward_means),
        "reward_mean": reward_means,
        "policy_uri": published["uri"],
        "mlflow_run_id": run_id,
        "mlflow": links["run"],
        "mlflow_runs": links["runs"],              # (a tracking server: the runs list in rlflow's shared view)
        "mlflow_view": links["view"],              # (a database or folder: the command that shows it)
        "mlflow_traces": links["traces"],          # (the run's Traces tab: its episodes, tracking.traces)
        "model_version": tracker.model_version(published["uri"]),
        "best_policy": store.get_pointer(layout.best(cfg.run.name)),
        "held_out": _held_out(cfg, store),
        "champion": champion_policy_uri(cfg) if cfg.publish.register_model else None,
        "cost_usd": cost_so_far,
        "reward_curve": str(curve.absolute()),
    }

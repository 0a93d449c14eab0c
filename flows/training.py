"""The training loop: N iterations of generate → reward → train → publish, as a Prefect flow.

    rlflow run configs/tiny.yaml                   # the CLI calls train_flow(config)

Read top to bottom:
  1. preflight: everything a user can get wrong is checked before the first byte is written
     (store reachable, dataset + prompt column, reward functions import, model folder);
  2. one MLflow run per rlflow run (found again on resume);
  3. for each iteration, the four stage tasks; each returns at once if its output already exists in the
     store from the same inputs, so a run killed anywhere and started again ends with exactly
     `run.iterations` iterations, none repeated, none skipped;
  4. every `eval.every` iterations the published policy is scored on held-out prompts; policy/BEST follows
     the best of them;
  5. metrics of each iteration are logged once (iterations already in MLflow are not logged again);
  6. at the end: reward curve plot, summary.
Stages meet only in the store; this file passes keys, never tensors.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import layout
from tasks.config import Config
from tasks.data import load_prompts
from tasks.evaluate import evaluate
from tasks.generate import generate
from tasks.models import base_path, load_tokenizer, open_store
from tasks.publish import publish
from tasks.reward import reward
from tasks.scoring import load_functions
from tasks.tracking import Tracker
from tasks.train import train

# Stage results are small dicts of keys and metrics; the store is the cache, so Prefect's is off.
generate_task = task(generate, name="generate", task_run_name="generate[iter {iteration}]", cache_policy=NO_CACHE)
reward_task = task(reward, name="reward", task_run_name="reward[iter {iteration}]", cache_policy=NO_CACHE)
train_task = task(train, name="train", task_run_name="train[iter {iteration}]", cache_policy=NO_CACHE)
publish_task = task(publish, name="publish", task_run_name="publish[iter {iteration}]", cache_policy=NO_CACHE)
evaluate_task = task(evaluate, name="evaluate", task_run_name="evaluate[iter {iteration}]", cache_policy=NO_CACHE)


def preflight(cfg: Config) -> None:
    """Raise UserError for any input mistake; writes nothing."""
    open_store(cfg).check()
    load_prompts(cfg)
    if cfg.eval.every:
        load_prompts(cfg, split="eval")
    load_functions(cfg)
    load_tokenizer(base_path(cfg))


class Progress:
    """A progress bar with one line per iteration on a terminal; plain lines elsewhere (CI, Prefect workers)."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

        self.console = Console(stderr=False)
        self.bar = None
        if self.console.is_terminal:
            self.bar = Bar(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           console=self.console, transient=True)
            self.task = self.bar.add_task("iterations", total=total, completed=start)
            self.bar.start()

    def line(self, text: str) -> None:
        (self.bar.console if self.bar else self.console).print(text, highlight=False)
        if self.bar:
            self.bar.advance(self.task)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


@flow(name="rlflow-train", flow_run_name="{config.run.name}", log_prints=False)
def train_flow(config: Config) -> dict:
    """Run (or resume) `config.run.iterations` iterations of generate → reward → train → publish."""
    cfg = config
    log = get_run_logger()
    preflight(cfg)
    store = open_store(cfg)
    tracker = Tracker(cfg, store.root)
    run_id = tracker.start()
    already_logged = tracker.last_logged_iteration()
    log.info("run %s: store %s, MLflow run %s", cfg.run.name, store.uri(cfg.run.name), run_id)

    reward_means: list[float] = []
    published = None
    progress = Progress(cfg.run.iterations, already_logged)
    try:
        for it in range(1, cfg.run.iterations + 1):
            t0 = time.perf_counter()
            policy = layout.BASE if it == 1 else layout.policy(cfg.run.name, it - 1)
            g = generate_task(cfg, it, policy)
            r = reward_task(cfg, it)
            t = train_task(cfg, it)
            p = publish_task(cfg, it)
            published = p
            e = {"metrics": {}}
            if cfg.eval.every and (it % cfg.eval.every == 0 or it == cfg.run.iterations):
                e = evaluate_task(cfg, it)
            reward_means.append(r["metrics"]["reward/mean"])
            if it > already_logged:
                metrics = {**g["metrics"], **r["metrics"], **t["metrics"], **p["metrics"], **e["metrics"],
                           "iteration/seconds": time.perf_counter() - t0}
                tracker.log_iteration(it, metrics, r["samples"], policy_uri=p["uri"])
                progress.line(f"iter {it:>4}/{cfg.run.iterations}  reward {r['metrics']['reward/mean']:.3f}  "
                              f"loss {t['metrics']['train/loss']:+.4f}  {time.perf_counter() - t0:5.2f}s")
                log.info("iteration %d: reward %.3f loss %.4f", it, r["metrics"]["reward/mean"], t["metrics"]["train/loss"])
    except BaseException:
        tracker.finish("FAILED")   # keeps what was logged; never masks the error that got us here
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
        "mlflow": tracker.run_url(),
        "model_version": tracker.model_version(published["uri"]),
        "best_policy": store.get_pointer(layout.best(cfg.run.name)),
        "reward_curve": str(curve.absolute()),
    }

"""What a person watching a run sees: a progress line per iteration on the terminal, and in the Prefect dashboard
one artifact per flow run, the run's report (`<run>-report`): made when the run starts (links to MLflow and the
store) and updated in place every `tracking.dashboard_every` iterations and after the last, so the flow run's
Artifacts tab holds one card, the latest report, and the key's page one version per flow run (each start or
resume). The report: the reward per iteration (a sparkline of the run, a table of the newest iterations with a bar
each), the latest iteration's metrics, stage times and cost, a few samples, and the latest evaluation's pictured
episodes (eval.screenshots: a strip of the pages per episode, tasks/envs/runtime/screens.py)."""

from __future__ import annotations

import base64
import contextvars
import math
import re
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from prefect.artifacts import create_markdown_artifact

from tasks.core.config import STAGES
from tasks.core.tracking import readable_prompt

if TYPE_CHECKING:
    from tasks.core.config import Config


class Progress:
    """A progress bar with one line per iteration on a terminal; plain lines elsewhere (CI, Prefect workers)."""

    def __init__(self, total: int, start: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self.console = Console(stderr=False)
        self.bar = None
        if self.console.is_terminal:
            self.bar = Bar(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           console=self.console, transient=True)
            self.task = self.bar.add_task("iterations", total=total, completed=start)
            self.bar.start()

    def line(self, text: str) -> None:
        """An iteration's line: printed, and the bar moves on."""
        self.note(text)
        if self.bar:
            self.bar.advance(self.task)

    def note(self, text: str) -> None:
        """A line about the run (resuming, complete): printed, the bar stays."""
        # (soft_wrap: a long line, a path, is never cut into pieces where no terminal is)
        (self.bar.console if self.bar else self.console).print(text, highlight=False, markup=False, soft_wrap=True)

    def close(self) -> None:
        if self.bar:
            self.bar.stop()


def slug(text: str) -> str:
    """An artifact key from a run name (Prefect keys: lowercase letters, digits, dashes)."""
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:60] or "run"


TREND_ROWS = 10        # newest iterations in the report's table (the sparkline has them all)
SPARK_POINTS = 60      # a longer run's sparkline shows bucket means
BAR_WIDTH = 20         # the table's bar at the run's highest reward
BLOCKS = "▁▂▃▄▅▆▇█"
SAMPLES_SHOWN = 4      # of tracking.sample_completions (MLflow's samples table has them all)
STRIPS_SHOWN = 3       # pictured episodes in the report (MLflow's artifacts have every frame)
POST_SECONDS = 30.0    # a report the Prefect API has not taken by then is left to finish on its own: the run goes on


def _number(value: float) -> str:
    """A metric in a table: NaN (nothing scored) as a dash."""
    return f"{value:.4g}" if math.isfinite(value) else "—"


def _scored(metrics: dict) -> bool:
    """Whether an iteration's metrics have a mean reward (a batch nothing scored has NaN: no bar, no point)."""
    return "reward/mean" in metrics and math.isfinite(metrics["reward/mean"])


class Report:
    """The flow run's `<run>-report` artifact. `record` each iteration (the trend, in memory), `post` when the
    dashboard is due: the artifact is updated in place (Prefect's PATCH), never a new card per iteration."""

    def __init__(self, cfg: Config, links: dict, store_uri: str):
        self.cfg, self.links, self.store_uri = cfg, links, store_uri
        self.key = f"{slug(cfg.run.name)}-report"
        self.trend: dict[int, dict[str, float]] = {}
        self.posted: int | None = None         # the iteration the report shows
        self.pictures: list[str] = []          # the latest evaluation's strips, as markdown
        self.sending: threading.Thread | None = None    # the post on its way to the Prefect API
        self.late = False                      # a post outlived POST_SECONDS (said once)
        self.id = create_markdown_artifact(key=self.key, markdown=self._markdown(None),
                                           description=self._described(None))

    def record(self, it: int, metrics: dict) -> None:
        keep = ("reward/mean", "train/loss", self.cfg.eval.metric_key())
        self.trend.setdefault(it, {}).update({k: float(metrics[k]) for k in keep if k in metrics})

    def post(self, it: int, metrics: dict, samples: list[dict], policy_uri: str) -> None:
        """Update the card, waiting at most POST_SECONDS for the Prefect API: one that stopped answering (a hung
        server) held the run there for good. A post still on its way when the next is due: that one is skipped
        (its numbers go with the one after)."""
        self.record(it, metrics)
        if self.sending is not None and it == self.cfg.run.iterations:
            self.sending.join(POST_SECONDS)     # (the last: after the one on its way, if that one ends in time)
        if self.sending is not None and self.sending.is_alive():
            if it == self.cfg.run.iterations:
                print(f"warning: the run's report shows an earlier iteration: the Prefect API has not answered a "
                      f"post for over {POST_SECONDS:g} s", file=sys.stderr, flush=True)
            return                              # (posted stays: the run's end tries its last iteration again)
        self.posted = it
        update = (self._markdown((it, metrics, samples, policy_uri)), self._described(it))
        self.sending = threading.Thread(target=contextvars.copy_context().run, args=(self._send, *update),
                                        daemon=True, name="rlflow-report")     # (the caller's Prefect settings)
        self.sending.start()
        self.sending.join(POST_SECONDS)
        if self.sending.is_alive() and not self.late:
            self.late = True
            print(f"warning: the Prefect API did not take the run's report in {POST_SECONDS:g} s (iteration {it}): "
                  f"the report is behind until it answers; the run goes on (said once)", file=sys.stderr, flush=True)

    def _send(self, data: str, description: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import ArtifactUpdate

        try:
            with get_client(sync_client=True) as client:
                client.update_artifact(self.id, ArtifactUpdate(data=data, description=description))
        except Exception as e:  # noqa: BLE001 - the card is not the run's: said, and the run goes on
            print(f"warning: the run's report was not updated: {type(e).__name__}: {str(e)[:200]}",
                  file=sys.stderr, flush=True)

    def _described(self, it: int | None) -> str:
        m = self.trend.get(it or 0, {})
        where = (f"iteration {it}/{self.cfg.run.iterations}"
                 + (f", reward {m['reward/mean']:.3f}" if _scored(m) else "") if it else "starting")
        return (f"{where}: rlflow run {self.cfg.run.name}'s report, updated in place (reward per iteration, the "
                f"latest iteration's metrics, stage times and cost, samples, links to MLflow and the store)")

    def _markdown(self, latest: tuple | None) -> str:
        cfg = self.cfg
        it = latest[0] if latest else None
        lines = [f"## {cfg.run.name} — " + (f"iteration {it}/{cfg.run.iterations}" if it else
                                             f"starting ({cfg.run.iterations} iterations)"), ""]
        if self.links.get("runs"):
            lines.append(f"[MLflow run]({self.links['run']}) (its metric charts) · [all runs]({self.links['runs']})")
        else:
            lines += [f"MLflow: `{self.links['run']}`; to see it, where the run ran:", "",
                      f"```\n{self.links['view']}\n```"]
        lines += ["", f"Store: `{self.store_uri}`" + (f" · latest policy: `{latest[3]}`" if latest else "")]
        lines += self._trend()
        if latest:
            lines += self._iteration(*latest)
        return "\n".join(lines + self.pictures)

    def picture(self, it: int, folder: Path, index: list[dict]) -> None:
        """An evaluation's pictured episodes (screens.py's folder and index): the first STRIPS_SHOWN strips,
        inline (data URIs: the report needs no server to show them), each with its task, actions and return;
        shown from the next post on."""
        lines = ["", f"### Evaluated episodes of {'the starting model' if it == 0 else f'v{it}'} "
                 f"({min(len(index), STRIPS_SHOWN)} of {len(index)} pictured; every frame in MLflow: screens/"
                 f"v{it:06d})"]
        for e in index[:STRIPS_SHOWN]:
            data = base64.b64encode((Path(folder) / e["strip"]).read_bytes()).decode()
            actions = " · ".join(f"{i}. {_cell(f['action'], 80)}" for i, f in enumerate(e["frames"], 1))
            got = e.get("return")
            lines += ["", f"**{_cell(e['prompt'], 200)}** — return {'—' if got is None else f'{got:g}'}", "",
                      f"![episode {e['episode']}](data:image/jpeg;base64,{data})", "", actions]
        self.pictures = lines

    def _trend(self) -> list[str]:
        """The reward per iteration: a sparkline of the whole run and a table of the newest iterations with a bar
        each (text: any markdown view draws it, Prefect's old UI and new)."""
        rewards = [(i, m["reward/mean"]) for i, m in sorted(self.trend.items()) if _scored(m)]
        if not rewards:
            return []
        step = -(-len(rewards) // SPARK_POINTS)           # (ceil: at most SPARK_POINTS bucket means)
        points = [sum(v for _, v in rewards[k:k + step]) / len(rewards[k:k + step])
                  for k in range(0, len(rewards), step)]
        low, high = min(v for _, v in rewards), max(v for _, v in rewards)

        def level(v: float, top: int, base: float) -> int:
            return round((v - base) / (high - base) * top) if high > base else top // 2

        spark = "".join(BLOCKS[level(v, len(BLOCKS) - 1, low)] for v in points)        # (lowest to highest)
        eval_key = self.cfg.eval.metric_key()
        lines = ["", "### Reward per iteration", "",
                 f"`{spark}` {rewards[0][1]:.3f} → {rewards[-1][1]:.3f} (iterations {rewards[0][0]}–{rewards[-1][0]}"
                 + (f", {step} per mark" if step > 1 else "") + f"; lowest {low:.3f}, highest {high:.3f})", "",
                 f"| iteration | reward (mean) | | loss | {eval_key} |", "|---:|---:|:---|---:|---:|"]
        for i, m in sorted(self.trend.items(), reverse=True)[:TREND_ROWS]:
            bar = "█" * level(m["reward/mean"], BAR_WIDTH, min(low, 0.0)) if _scored(m) else ""   # (from 0)
            cells = [_number(m[k]) if k in m else "" for k in ("reward/mean", "train/loss", eval_key)]
            lines.append(f"| {i} | {cells[0]} | `{bar or '·'}` | {cells[1]} | {cells[2]} |")
        return lines

    def _iteration(self, it: int, metrics: dict, samples: list[dict], policy_uri: str) -> list[str]:
        cfg = self.cfg
        rows = [("reward (mean)", "reward/mean"), ("loss", "train/loss"), ("KL to reference", "train/kl_ref"),
                ("mismatch KL", "train/mismatch_kl"), ("clip region", "train/clip_region"),
                ("completion length", "generate/completion_length"), (cfg.eval.metric_key(), cfg.eval.metric_key())]
        lines = ["", f"### Iteration {it}", "", "| metric | value |", "|---|---:|"]
        lines += [f"| {label} | {_number(metrics[k])} |" for label, k in rows if k in metrics]
        lines += ["", "| stage | seconds | cost (USD) |", "|---|---:|---:|"]

        def usd(key: str) -> str:
            return f"{metrics[key]:.4f}" if key in metrics else "—"

        for stage in STAGES:
            if f"time/{stage}_seconds" in metrics:
                lines.append(f"| {stage} | {metrics[f'time/{stage}_seconds']:.2f} | {usd(f'cost/{stage}_usd')} |")
        if "iteration/seconds" in metrics:
            lines.append(f"| **iteration** | {metrics['iteration/seconds']:.2f} | {usd('cost/iteration_usd')} |")
        lines += ["", f"Run cost so far: **{metrics['cost_usd']:.4f} USD**." if "cost_usd" in metrics else
                  "Run cost: no price known (cost.hourly_usd, or the price of the machines the sky launcher "
                  "launched)."]
        if samples:
            shown = samples[:SAMPLES_SHOWN]
            rewards = [k for k in shown[0] if k.startswith("reward")]
            lines += ["", f"### Samples of iteration {it} ({len(shown)} of {len(samples)}; all of them in MLflow)", "",
                      "| prompt | completion | " + " | ".join(rewards) + " |", "|---|---|" + "---:|" * len(rewards)]
            for s in shown:
                values = [f"{s[k]:.4g}" if isinstance(s.get(k), float) else _cell(s.get(k)) for k in rewards]
                lines.append(f"| {_cell(readable_prompt(s.get('prompt')))} | {_cell(s.get('completion'), 600)} | "
                             + " | ".join(values) + " |")
        return lines


def _cell(value, limit: int = 400) -> str:
    """Text in a markdown table cell: its own lines kept (<br>), nothing read as markup, long text cut."""
    text = "" if value is None else str(value)
    text = text if len(text) <= limit else text[:limit] + " …"
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
    return text.replace("\r", "").replace("\n", "<br>")

"""What a person watching a run sees: a progress line per iteration on the terminal, and the Prefect dashboard's
artifacts (a report, a samples table and links) for the flow run."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from tasks.core.config import STAGES

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


def post_mlflow_link(cfg: Config, url: str) -> None:
    """The MLflow run, once per flow run: a link to click for a tracking server; for a database or folder
    (nothing a browser can open) the command that shows it."""
    key = f"{slug(cfg.run.name)}-mlflow"
    if url.startswith(("http://", "https://")):
        create_link_artifact(key=key, link=url.split(" ")[0], link_text="MLflow run",
                             description="metrics, samples, model versions")
        return
    uri = cfg.tracking.uri
    create_markdown_artifact(key=key, description="metrics, samples, model versions", markdown=(
        f"### MLflow run of {cfg.run.name}\n\nTracked in `{uri}` (no server): to see it, run where the run ran\n\n"
        f"```\nmlflow ui --backend-store-uri {uri}\n```\n\nthen open http://127.0.0.1:5000 — {url}"))


def post_iteration(cfg: Config, it: int, metrics: dict, samples: list[dict], policy_uri: str) -> None:
    """The iteration as the Prefect dashboard shows it: a report, a samples table, links."""
    key = slug(cfg.run.name)
    rows = [("reward (mean)", "reward/mean"), ("loss", "train/loss"), ("KL to reference", "train/kl_ref"),
            ("mismatch KL", "train/mismatch_kl"), ("clip region", "train/clip_region"),
            ("completion length", "generate/completion_length"), (cfg.eval.metric_key(), cfg.eval.metric_key())]
    lines = [f"### {cfg.run.name} — iteration {it}/{cfg.run.iterations}", "", "| metric | value |", "|---|---:|"]
    lines += [f"| {label} | {metrics[k]:.4g} |" for label, k in rows if k in metrics]
    lines += ["", "| stage | seconds | cost (USD) |", "|---|---:|---:|"]
    def usd(key: str) -> str:
        return f"{metrics[key]:.4f}" if key in metrics else "—"

    for stage in STAGES:
        if f"time/{stage}_seconds" in metrics:
            lines.append(f"| {stage} | {metrics[f'time/{stage}_seconds']:.2f} | {usd(f'cost/{stage}_usd')} |")
    lines.append(f"| **iteration** | {metrics['iteration/seconds']:.2f} | {usd('cost/iteration_usd')} |")
    cost = (f"Run cost so far: **{metrics['cost_usd']:.4f} USD**." if "cost_usd" in metrics else
            "Run cost: no price known (cost.hourly_usd, or the price of the machines the sky launcher launched).")
    lines += ["", f"{cost} Policy: `{policy_uri}`"]
    create_markdown_artifact(key=f"{key}-report", markdown="\n".join(lines), description=f"iteration {it}")
    table = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()} for s in samples]
    if table:
        create_table_artifact(key=f"{key}-samples", table=table, description=f"sample completions, iteration {it}")
    create_link_artifact(key=f"{key}-policy", link=policy_uri, link_text=f"policy v{it}",
                         description=f"published policy, iteration {it}")

"""The config sections of where a run's things live and run: `store` (file:// or s3://, and `store.keep`, the
retention of checkpoints and policies), `tracking` (MLflow), `launcher` (where each stage runs: inline, a
local subprocess, SkyPilot) and `cost` (prices for the cost metric). STAGES, the stages' names, is here.

Assembled into the whole config, and re-exported, by tasks/core/config.py.
More: docs/internals.md (tasks/core/config_infra.py): the checks these sections make.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlparse

from pydantic import Field, StringConstraints, field_validator, model_validator

from tasks.core.config_base import HOW_NOT_WHAT, Section, has_control_character, renamed_key


class KeepConfig(Section):
    """Retention: which of a run's checkpoints and policies are kept.

    The run's lease holder deletes the rest at the start and the end of each flow run, manifest first. Never
    deleted: anything a resume needs (the newest checkpoint and the one before it, every checkpoint after the
    newest full one), rollouts and rewards, evaluated policies, the policies LATEST and BEST name, the MLflow
    champion, the whole policies deltas are built on (tasks/core/retention.py)."""

    checkpoints_last: int = Field(2, ge=0, le=1_000_000, description="Newest full checkpoints kept (0 = all).")
    checkpoints_every: int = Field(0, ge=0, le=1_000_000,
                                   description="Also keep the full checkpoint of every N-th iteration "
                                   "(0 = none).")
    policies_last: int = Field(0, ge=0, le=1_000_000, description="Newest published policies kept (0 = all).")
    policies_every: int = Field(0, ge=0, le=1_000_000,
                                description="Also keep the policy of every N-th iteration (0 = none).")


class StoreConfig(Section):
    """Where artifacts live: file:// or a local path, or s3://bucket/prefix."""

    uri: str = Field("file://./rlflow-store", description="Store root; each run writes under <uri>/<run.name>/.")
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, moto...); None = AWS.")
    region: str | None = Field(None, description="S3 region; None = boto3's default chain.")
    multipart_chunk_mb: int = Field(16, ge=5, le=5120,
                                    description="Multipart part size in MiB (S3's limits: 5 MiB to 5 GiB).")
    max_concurrency: int = Field(8, ge=1, le=1024, description="Parallel part transfers per file.")
    keep: KeepConfig = Field(KeepConfig(), description="Retention of checkpoints and policies.")
    # Credentials never live here: boto3 reads AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE.

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            parsed = urlparse(v)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError("expected http(s)://HOST[:PORT]")
            try:
                parsed.port                                     # noqa: B018 - raises on a bad port
            except ValueError:
                raise ValueError("expected http(s)://HOST[:PORT] with a port number") from None
        return v

    @field_validator("uri")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if "://" in v and not v.startswith(("file://", "s3://")):
            raise ValueError("expected file://PATH, s3://BUCKET[/PREFIX] or a local path")
        if "://" not in v and re.match(r"[A-Za-z][A-Za-z0-9+.-]+:", v):       # s3:/bucket, file:/x (a slash short)
            raise ValueError("expected file://PATH, s3://BUCKET[/PREFIX] or a local path (a scheme with two slashes; "
                             "./NAME for a local folder whose name has a colon)")
        if v.startswith("s3://") and not v[5:].strip("/"):
            raise ValueError("s3:// URI needs a bucket name")
        if has_control_character(v):
            raise ValueError("expected a URI without control characters (a newline, a tab, NUL)")
        if v.startswith("s3://") and any(part in ("", ".", "..") for part in v[5:].rstrip("/").split("/")[1:]):
            raise ValueError("s3://BUCKET/PREFIX: a prefix with an empty, '.' or '..' part (S3 keeps them as text in "
                             "the keys; MinIO refuses them)")
        if not (v[len("file://"):] if v.startswith("file://") else v).strip():
            raise ValueError("expected a folder: file://PATH (file://./rlflow-store, file:///abs/path) or a local "
                             "path, not an empty one (which would write the store into the working directory)")
        try:
            here = Path.cwd()
        except OSError:                  # (a working directory that was removed: preflight says so)
            here = Path(".")
        if Path(v[len("file://"):] if v.startswith("file://") else v).expanduser() in (Path("."), here):
            raise ValueError("the working directory itself; expected a folder of the store's own (./rlflow-store)")
        return v


TRACKING_SCHEMES = ("sqlite", "http", "https", "file", "postgresql", "mysql", "mssql", "databricks")


class TrackingConfig(Section):
    """MLflow."""

    uri: str = Field(default_factory=lambda: os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db",
                     validate_default=True,
                     description="MLflow tracking URI (sqlite:///..., http://host:5000); unset: $MLFLOW_TRACKING_URI, "
                     "else sqlite:///mlflow.db in the working directory. MLflow's filesystem backend (a folder, "
                     "file://) only with MLFLOW_ALLOW_FILE_STORE=true, MLflow's own opt-out of its refusal.")
    experiment: str = Field("rlflow", min_length=1, max_length=256, pattern=r"\S",
                            description="MLflow experiment name (at most 256 characters: MLflow's database column, "
                            "which PostgreSQL and MySQL enforce; no control characters).")
    sample_completions: int = Field(8, ge=0, le=1_000_000,
                                    description="Completions per iteration logged to the samples table.")
    traces: bool = Field(True, description="Log every evaluated episode, and the samples table's completions, as "
                         "MLflow traces of the run: a span per model call and environment step or tool call, each "
                         "reward function's score as feedback (docs/operations.md, 'Reading episodes').")
    flush_seconds: float = Field(5.0, ge=0, le=86400,
                                 description="Send metrics/samples/model versions at most this often "
                                 "(s); 0 = every iteration. Batching keeps a remote server off the training path.")
    dashboard_every: int = Field(1, ge=0, le=1_000_000,
                                 description="Update the flow run's Prefect report (one artifact) every N "
                                 "iterations and after the last; 0 = only after the last.")

    @field_validator("experiment")
    @classmethod
    def _printable(cls, v: str) -> str:
        if has_control_character(v):
            raise ValueError("expected a name without control characters (a newline, a tab, NUL)")
        return v

    @field_validator("uri")
    @classmethod
    def _tracking_scheme(cls, v: str) -> str:
        if (fault := tracking_uri_fault(v)) is not None:
            raise ValueError(fault + (" (the value of $MLFLOW_TRACKING_URI)" if v == os.environ.get(
                "MLFLOW_TRACKING_URI") else ""))
        return v


def tracking_scheme(uri: str) -> str:
    """A tracking URI's scheme without its driver (postgresql+psycopg2:// -> postgresql); '' for a bare path."""
    return uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else (uri.split(":", 1)[0] if ":" in uri else "")


def tracking_uri_fault(v: str) -> str | None:
    """What is wrong with a tracking URI, from its text alone (what must answer is preflight's), or None."""
    if not v.strip() or "\x00" in v:
        return "expected an MLflow tracking URI (sqlite:///mlflow.db, http://host:5000)"
    if v in ("databricks", "databricks-uc") or v.startswith(("databricks:", "databricks-uc:")):
        return None                      # (MLflow's Databricks URIs: its client finds the workspace and credentials)
    scheme = tracking_scheme(v)
    drive = len(scheme) == 1 and v[1:3] in (":\\", ":/")
    if scheme and scheme not in TRACKING_SCHEMES and not drive:
        return f"expected one of {', '.join(s + '://' for s in TRACKING_SCHEMES)} or a local folder"
    if v.startswith("sqlite"):
        driver, _, rest = v.partition(":")
        if driver not in ("sqlite", "sqlite+pysqlite"):
            return f"{driver}: expected sqlite:///PATH (SQLAlchemy's sqlite driver)"
        path = rest[3:].split("?", 1)[0] if rest.startswith("///") else ""
        if not path.strip() or path.startswith(":memory:"):
            return ("expected sqlite:///PATH (relative to the working directory) or sqlite:////PATH (absolute): "
                    "a database file, which every stage and later run reads")
    if (drive or scheme in ("", "file")) and os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in (
            "1", "true"):
        return ("MLflow's filesystem backend (a folder or file:// URI), which MLflow 3 refuses (maintenance mode); "
                "expected sqlite:///PATH or an http(s) server (MLFLOW_ALLOW_FILE_STORE=true is MLflow's opt-out)")
    return None


Stage = Literal["generate", "reward", "train", "publish", "evaluate"]
STAGES: tuple[str, ...] = get_args(Stage)
StageWhere = Literal["inline", "local", "sky"]


class LauncherConfig(Section):
    """Where each stage runs. The same config runs with any launcher; only this section changes."""

    where: StageWhere = Field("inline", description="Where the stages run. inline: in the flow's process; local: "
                              "a subprocess running the stage recipe's `run` (sky/<stage>.yaml) exactly as "
                              "SkyPilot would; sky: on SkyPilot clusters (launched once per flow run, reused by "
                              "exec). (launcher.mode, before: read as launcher.where.)")
    stages: dict[Stage, StageWhere] = Field(
        {}, description="Where a stage runs, overriding `where` for it, e.g. {train: sky}.")
    recipes: str = Field("sky", description="Folder of the stage recipes (<stage>.yaml). A relative one is that "
                         "folder of the working directory if there is one, else of the rlflow checkout (its sky/); "
                         "the sky launcher refuses a relative one that is not in the working directory, which "
                         "the recipes' `workdir: .` sends to the clusters.")
    retries: int = Field(3, ge=0, le=20, description="Retries of a stage after an infrastructure failure "
                         "(killed process, preempted or vanished cluster, store error); user errors are "
                         "never retried.")
    retry_backoff_seconds: float = Field(10.0, ge=0, le=86400, description="First retry delay; doubles at each retry.")
    sky_python: str | None = Field(None, description="Python of the SkyPilot environment (the `sky` launcher "
                                   "calls the SDK there); None = .venv-sky/bin/python in the working directory, "
                                   "else in the repository root (make setup), else `python3`.")
    cluster_prefix: str = Field("rlflow", pattern=r"^[a-z][a-z0-9-]{0,30}$",
                                description="SkyPilot cluster names: <prefix>-<run>-<role>; a run name with "
                                "capitals, `_` or `.`, or too long, is lowercased and cut, and a hash of it added.")
    idle_minutes_to_autostop: int = Field(10, ge=1, le=525_600, description="SkyPilot autostop of idle clusters.")
    down: bool = Field(True, description="Tear the clusters down when the flow ends (else autostop only).")
    managed_jobs: bool = Field(False, description="Run sky stages as SkyPilot managed jobs (sky.jobs.launch): "
                               "SkyPilot itself recovers a preempted spot job.")
    accelerators: dict[Literal["generate", "train", "reward", "evaluate", "publish", "env", "judge"],
                       Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*(:[0-9]+)?$")]] = Field(
        {}, json_schema_extra=HOW_NOT_WHAT,
        description="The GPU type per role on SkyPilot, overriding the recipe's resources.accelerators, e.g. "
                    "{generate: 'L4:1', train: 'A100:8'} (the rollout GPU and the actor GPU): each generate "
                    "replica gets one such machine; judge: each reward.models server on sky.")

    @model_validator(mode="before")
    @classmethod
    def _mode_is_where(cls, data: Any) -> Any:
        return renamed_key(data, "launcher", "mode", "where")

    @field_validator("sky_python")
    @classmethod
    def _a_path(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("empty; expected the path or command of a Python with SkyPilot, or null for the "
                             "default (.venv-sky/bin/python, else python3)")
        return v

    @field_validator("accelerators")
    @classmethod
    def _some_of_each(cls, v: dict) -> dict:
        for role, spec in v.items():
            if ":" in spec and int(spec.rsplit(":", 1)[1]) == 0:
                raise ValueError(f"{role}: {spec!r} asks for 0 of them; expected a count of 1 or more (or the "
                                 f"type alone, one)")
        return v

    def where_of(self, stage: str) -> str:
        return self.stages.get(stage, self.where)

    def remote_stages(self) -> list[str]:
        """Stages that run outside the flow's process (local subprocess or SkyPilot)."""
        return [s for s in STAGES if self.where_of(s) != "inline"]


class CostConfig(Section):
    """Prices for the cost metric (cost_usd = stage seconds x hourly price)."""

    hourly_usd: dict[Stage, Annotated[float, Field(ge=0, le=1e6)]] = Field(
        {}, description="Hourly price per stage when SkyPilot's catalog cannot tell (inline/local: the price "
                        "of this machine); a stage with no price known logs no cost metric.")

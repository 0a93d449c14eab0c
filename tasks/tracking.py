"""MLflow: one MLflow run per rlflow run (a resumed run continues its MLflow run), metrics per iteration,
a sample table, the reward-curve plot, and each published policy as a registered model version.

All calls go through an explicit MlflowClient for `tracking.uri`; nothing touches MLflow's global state.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from tasks.errors import UserError

TAG_RUN, TAG_STORE = "rlflow.run", "rlflow.store"
CURVE_METRIC = "reward/mean"


def _client(uri: str):
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, (list, tuple)) else str(v)
    return out


class Tracker:
    """The MLflow side of one training run."""

    def __init__(self, cfg, store_root: str):
        self.cfg = cfg
        self.client = _client(cfg.tracking.uri)
        self.store_root = store_root
        self.run_id: str | None = None

    def start(self) -> str:
        """Find this run's MLflow run (same run name and store) or create it; log the resolved config."""
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException

        cfg = self.cfg
        try:
            exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg.tracking.experiment)
        except MlflowException as e:
            raise UserError(f"tracking.uri: {cfg.tracking.uri}: {str(e).splitlines()[0][:200]}") from None
        found = self.client.search_runs(
            [exp_id], filter_string=f"tags.`{TAG_RUN}` = '{cfg.run.name}' and tags.`{TAG_STORE}` = '{self.store_root}'",
            max_results=1, order_by=["attributes.start_time DESC"])
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            logged = found[0].data.params
        else:
            run = self.client.create_run(exp_id, run_name=cfg.run.name,
                                         tags={TAG_RUN: cfg.run.name, TAG_STORE: self.store_root})
            self.run_id, logged = run.info.run_id, {}
        params = {k: v[:6000] for k, v in _flatten(cfg.model_dump(mode="json")).items() if k not in logged}
        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        return self.run_id

    def last_logged_iteration(self) -> int:
        history = self.client.get_metric_history(self.run_id, CURVE_METRIC)
        return max((m.step for m in history), default=0)

    def log_iteration(self, iteration: int, metrics: dict[str, float], samples: list[dict] | None = None) -> None:
        from mlflow.entities import Metric
        import time as _t

        now = int(_t.time() * 1000)
        batch = [Metric(k, float(v), now, iteration) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])
        if samples:
            columns = {k: [s[k] for s in samples] for k in samples[0]}
            self.client.log_table(self.run_id, data=columns, artifact_file=f"samples/iter-{iteration:06d}.json")

    def log_reward_curve(self, rewards: list[float], out_dir: Path) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / "reward_curve.png"
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(rewards) + 1), rewards, marker="o", markersize=3)
        ax.set_xlabel("iteration")
        ax.set_ylabel("mean reward")
        ax.set_title(f"{self.cfg.run.name}: mean reward per iteration")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        self.client.log_artifact(self.run_id, str(path), "plots")
        return path

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)

    def run_url(self) -> str:
        uri = self.cfg.tracking.uri
        if uri.startswith(("http://", "https://")):
            exp = self.client.get_run(self.run_id).info.experiment_id
            return f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{self.run_id}"
        return f"{uri} run {self.run_id} (view: mlflow ui --backend-store-uri {uri})"


def register_policy(cfg, run_id: str, policy_uri: str, iteration: int) -> str:
    """Register `policy_uri` as a model version of `publish.registered_model_name` (idempotent by URI)."""
    from mlflow.exceptions import MlflowException

    client = _client(cfg.tracking.uri)
    name = cfg.publish.registered_model_name or cfg.run.name
    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
            raise
    for mv in client.search_model_versions(f"name = '{name}'"):
        if mv.tags.get("rlflow.policy_uri") == policy_uri:
            version = mv.version
            break
    else:
        version = client.create_model_version(
            name, source=policy_uri, run_id=run_id,
            tags={"rlflow.policy_uri": policy_uri, "rlflow.iteration": str(iteration)}).version
    # No alias to set: MLflow reserves `latest`, and `models:/<name>/latest` always names the newest version.
    return str(version)

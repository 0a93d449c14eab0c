"""Stage 4 — publish: make iteration N's weights the policy that generate and users read.

    python -m tasks.publish --config configs/tiny.yaml --iteration 3 [--mlflow-run-id ID]

Copies the checkpoint's model folder (safetensors + config + tokenizer) to the immutable `<run>/policy/vN` in
place (S3: a server-side copy; nothing is downloaded), writes its manifest last, then moves
`<run>/policy/LATEST` forward; given an MLflow run id (the stage CLI's --mlflow-run-id) it also registers the
folder as a version of the MLflow registered model (`models:/NAME/latest` names the newest). Each step is
idempotent, so a publish killed anywhere and run again completes what is missing and repeats nothing.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import open_store

if TYPE_CHECKING:
    from tasks.core.config import Config


def publish(cfg: Config, iteration: int, mlflow_run_id: str | None = None) -> dict:
    """Publish iteration `iteration`'s trained weights; returns {key, uri, metrics}."""
    store = open_store(cfg)
    run = cfg.run.name
    key = layout.policy(run, iteration)
    src = layout.checkpoint(run, iteration)
    src_manifest = require_input(store, src, iteration, "checkpoint", "train")
    fp = fingerprint(cfg, (), iteration=iteration, checkpoint=src_manifest["files"][layout.CKPT_STATE]["sha256"])
    done = reuse(store, key, fp)
    if done is None:
        t0 = time.perf_counter()
        size = sum(f["size"] for rel, f in src_manifest["files"].items() if rel.startswith(layout.CKPT_MODEL + "/"))
        metrics = {"publish/bytes": float(size)}
        # In place: on S3 a server-side copy, so the weights never travel through the machine that publishes.
        manifest = store.copy_folder(src, key, prefix=layout.CKPT_MODEL + "/",
                                     meta={"fingerprint": fp, "iteration": iteration, "source": src,
                                           "metrics": metrics})
        metrics["publish/seconds"] = time.perf_counter() - t0
        done = result(store, key, manifest)
        done["metrics"] = metrics
    store.advance_pointer(layout.latest(run, "policy"), key)
    if cfg.publish.register_model and mlflow_run_id:
        from tasks.core.tracking import register_policy
        done["model_version"] = register_policy(cfg, mlflow_run_id, done["uri"], iteration)
    return done


if __name__ == "__main__":
    stage_cli(publish, "publish", takes_tracking=True)

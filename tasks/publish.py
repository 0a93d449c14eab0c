"""Stage 4 — publish: make iteration N's weights the policy that generate and users read.

    python -m tasks.publish --config configs/tiny.yaml --iteration 3 [--mlflow-run-id ID]

Makes the checkpoint's model folder (weights + config + tokenizer) the immutable `<run>/policy/vN`: copied in
place (S3: a server-side copy; nothing is downloaded) when it is published whole, which every
`publish.anchor_every`-th policy is; the ones between are published as a sparse delta against the last whole
one when that is smaller (tasks/core/policy.py; generators rebuild and check them). The manifest is written
last, then `<run>/policy/LATEST` moves forward; given an MLflow run id (the stage CLI's --mlflow-run-id) it
also registers the folder as a version of the MLflow registered model (`models:/NAME/latest` names the
newest). Each step is idempotent, so a publish killed anywhere and run again completes what is missing and
repeats nothing.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.core import layout
from tasks.core.policy import anchor_of, encode, materialize, write_delta
from tasks.core.stage import fingerprint, require_input, result, reuse, stage_cli
from tasks.core.store import Store, open_store

if TYPE_CHECKING:
    from tasks.core.config import Config


def publish(cfg: Config, iteration: int, mlflow_run_id: str | None = None) -> dict:
    """Publish iteration `iteration`'s trained weights; returns {key, uri, metrics}."""
    store = open_store(cfg)
    run = cfg.run.name
    key = layout.policy(run, iteration)
    src = layout.checkpoint(run, iteration)
    src_manifest = require_input(store, cfg, "publish", iteration, ("train", iteration))
    fp, made = fingerprint(cfg, (), iteration=iteration,
                           checkpoint=src_manifest["files"][layout.CKPT_STATE]["sha256"])
    done = reuse(store, key, fp, made)
    if done is not None and not store.remote:
        store.verify(key)      # (a resume walks again only its last iterations: the policies the next samples load,
        #                        and a complete run's final one, checked byte for byte: a corrupt one is made again;
        #                        not downloaded to be checked from a remote store, whose objects carry checksums)
    if done is None:
        t0 = time.perf_counter()
        size = sum(f["size"] for rel, f in src_manifest["files"].items() if rel.startswith(layout.CKPT_MODEL + "/"))
        meta = {"fingerprint": fp, "made_of": made, "iteration": iteration, "source": src}
        anchor = _anchor(store, cfg, iteration)
        delta = None
        if anchor is not None:
            model = store.local(src) / layout.CKPT_MODEL
            delta = encode(model, materialize(store, anchor))
        if delta is None:
            # In place: on S3 a server-side copy, so the weights never travel through the machine that publishes.
            metrics = {"publish/bytes": float(size), "publish/delta": 0.0}
            manifest = store.copy_folder(src, key, prefix=layout.CKPT_MODEL + "/", meta={**meta, "metrics": metrics})
        else:
            metrics = {"publish/bytes": float(size - delta.whole + delta.size), "publish/delta": 1.0,
                       "publish/delta_share": delta.size / max(delta.whole, 1)}
            with tempfile.TemporaryDirectory(prefix="rlflow-publish-") as tmp:
                write_delta(delta, model, Path(tmp), anchor)
                manifest = store.put_folder(key, Path(tmp), meta={**meta, "anchor": anchor, "metrics": metrics},
                                            give_up=True)
        metrics["publish/seconds"] = time.perf_counter() - t0
        done = result(store, key, manifest)
        done["metrics"] = metrics
    store.advance_pointer(layout.latest(run, "policy"), key)
    if cfg.publish.register_model and mlflow_run_id:
        from tasks.core.registry import register_policy
        done["model_version"] = register_policy(cfg, mlflow_run_id, done["uri"], iteration)
    return done


def _anchor(store: Store, cfg: Config, iteration: int) -> str | None:
    """The whole policy iteration `iteration` may be published as a delta against (None: publish it whole):
    the previous policy if it is whole, else the one that one is built on."""
    deltas = cfg.publish.delta == "always" or (cfg.publish.delta == "auto" and store.remote)
    if not deltas or cfg.train.lora_r or iteration == 1 or iteration % cfg.publish.anchor_every == 0:
        return None                                  # (an adapter is small whole)
    previous = layout.policy(cfg.run.name, iteration - 1)
    manifest = store.manifest(previous)
    if manifest is None:
        return None
    return anchor_of(manifest) or previous


if __name__ == "__main__":
    stage_cli(publish, "publish", takes_tracking=True)

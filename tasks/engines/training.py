"""The training engines' factory, and what every engine shares (the contract, TrainingEngine:
tasks/core/contracts.py).

    Engine = training_engine(cfg)                    # the class `train.engine` names: torch | deepspeed
    if Engine.launch(cfg, iteration): ...            # deepspeed: started its workers here; they trained
    engine = Engine.open(cfg, store, previous)       # model, optimizer, RNG (from checkpoint `previous`)
    ... engine.backward(loss) per micro-batch, engine.step() per pass (tasks/train.py: optimise) ...
    engine.save(folder, iteration); engine.close()

The GRPO math, batching and metrics are tasks/algorithms/'s, the same for every engine; an engine owns the
model, the optimizer, the processes and the checkpoint format. `update`, `write_checkpoint` and `restore`
below are one iteration's work on any engine; one class calls them, the trainer (tasks/engines/trainer.py:
Trainer), in process mode and resident alike.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.algorithms.batching import shard_batches
from tasks.algorithms.learners.registry import make as make_learner
from tasks.algorithms.update import optimise
from tasks.core import data, layout, rollout
from tasks.core.hashing import sha256_file

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.contracts import Learner, Rollout, TrainingEngine
    from tasks.core.store import Store


def training_engine(cfg: Config) -> type[TrainingEngine]:
    """The engine class `train.engine` names (deepspeed is imported only when chosen)."""
    if cfg.train.engine == "deepspeed":
        from tasks.engines.deepspeed_engine import DeepSpeedEngine
        return DeepSpeedEngine
    from tasks.engines.torch_engine import TorchEngine
    return TorchEngine


# ------------------------------------------------------------------------------------- one iteration, any engine

def update(engine: TrainingEngine, cfg: Config, store: Store, iteration: int, t0: float | None = None) -> dict:
    """Iteration `iteration`'s update on its stored scored rollouts, by the learner train.algorithm names: the
    rows it trains on (this iteration's, and the earlier and off-line ones it replays, loaded here), what it makes
    of their rewards over the whole batch (groups complete), this process's shard of micro-batches, the
    optimiser passes. Returns the train/* metrics (`t0`: when the stage started, for train/seconds)."""
    t0 = time.perf_counter() if t0 is None else t0
    tc = cfg.train
    learner = make_learner(cfg, iteration)
    records = rollout.load(store, layout.rewards(cfg.run.name, iteration))
    rewards = torch.tensor([math.nan if r.reward is None else r.reward for r in records])
    older = [r for k in learner.replay(iteration) for r in rollout.load(store, layout.rewards(cfg.run.name, k))]
    offline = [r for key in offline_rollouts(cfg, store) for r in rollout.load(store, key)]
    records = offline + older + records
    scores = episode_scores(learner, records)
    batches = shard_batches(records, scores, engine.tokenizer.pad_token_id, tc, engine.device, engine.rank,
                            engine.world_size)
    t1 = time.perf_counter()
    stats = optimise(engine, batches, cfg, iteration, learner)
    engine.global_step += tc.num_iterations
    metrics = stats.metrics(rewards, scores, tc, time.perf_counter() - t0, learner)
    if learner.off_policy:
        metrics["train/rows"] = float(len(records))       # this iteration's, the replayed and the off-line
    metrics["train/update_seconds"] = time.perf_counter() - t1        # the optimiser passes alone
    return metrics


def episode_scores(learner: Learner, records: list[Rollout]) -> torch.Tensor:
    """learner.scores over the episodes: an agent's episode split step-wise (Rollout.part > 0 after its first
    sample) counts once in the groups' statistics, and each of its samples gets the episode's score."""
    rewards = torch.tensor([math.nan if r.reward is None else r.reward for r in records])
    lead = [i for i, r in enumerate(records) if not r.part]
    if len(lead) == len(records):
        return learner.scores(rewards)
    own = learner.scores(rewards[lead])
    episode = (torch.tensor([not r.part for r in records]).cumsum(0) - 1).clamp(min=0)   # each row's episode
    return own[episode]


def offline_rollouts(cfg: Config, store: Store) -> list[str]:
    """The learner's off-line rollouts (train.learner.offline_rollouts), each checked to be a committed folder of
    scored rollouts: a reward stage's output (its manifest says how scoring went), not a generate output whose
    rows have no reward yet, and every row with a reward (the learner would otherwise train on rows with none).
    One line if not; the flow's preflight and the train stage (run by hand too) both check."""
    from tasks.core.errors import UserError

    field = "train.learner.offline_rollouts"
    keys = [key.strip("/") for key in cfg.train.learner.offline()]
    for key in keys:
        manifest = store.manifest(key)
        if manifest is None or rollout.FILE not in manifest["files"]:
            raise UserError(f"{field}: {key}: no scored rollouts at {store.uri(key)} (expected a rewards folder of "
                            f"this store, e.g. <run>/iter-000001/rewards)")
        if "errors" not in (manifest.get("meta") or {}):
            raise UserError(f"{field}: {key}: unscored rollouts (a generate output) at {store.uri(key)}; expected "
                            f"a rewards folder of this store, e.g. <run>/iter-000001/rewards")
        records = rollout.load(store, key)
        unscored = [i for i, r in enumerate(records) if r.reward is None]
        if not records or unscored:
            what = "no rows" if not records else (f"row {unscored[0]}" + (f" and {len(unscored) - 1} more" if
                                                  len(unscored) > 1 else "") + f" of {len(records)} with reward null")
            raise UserError(f"{field}: {key}: {what} at {store.uri(key)}; off-line rows must all be scored")
    return keys


def write_checkpoint(store: Store, cfg: Config, key: str, iteration: int, step: int, files: Callable[[Path], dict],
                     meta: dict, kind: str = "full", rank: int = 0, keep_policy_here: bool = True,
                     before_commit: Callable[[], None] | None = None) -> dict | None:
    """A checkpoint folder: `files(folder)` writes its files (every process calls this: deepspeed saves
    collectively) and returns what state.json adds; process 0 then writes state.json and commits the folder
    (manifest last). `kind`: full (the engine's `save` or `snapshot`: a trainer can resume from it) or lean
    (`save_policy`: the policy alone). `keep_policy_here`: the policy's files stay in this machine's cache too
    (the next generate on this machine reads them without a download). Returns the manifest on process 0."""
    with tempfile.TemporaryDirectory(prefix="rlflow-ckpt-") as tmp:
        out = Path(tmp)
        extra = files(out)
        if rank != 0:
            return None
        state = {"iteration": iteration, "step": step,
                 "data_cursor": data.cursor(iteration + 1, cfg.generate.prompts_per_iteration), **extra}
        (out / layout.CKPT_STATE).write_text(json.dumps(state))
        if before_commit is not None:
            before_commit()
        policy = (lambda rel: rel.startswith(layout.CKPT_MODEL + "/")) if keep_policy_here else None
        return store.put_folder(key, out, meta={**meta, "kind": kind, "iteration": iteration}, keep_local=policy,
                                give_up=True)


def lean_files(engine: TrainingEngine) -> Callable[[Path], dict]:
    """What a lean checkpoint holds: the policy (model/). Its state.json is a full checkpoint's of the same
    iteration, so the next iteration's fingerprint does not depend on the mode."""
    def files(out: Path) -> dict:
        engine.save_policy(out / layout.CKPT_MODEL)
        return {}
    return files


def newest_full(store: Store, run: str, at_most: int) -> tuple[str | None, int]:
    """The newest complete full checkpoint of iterations <= `at_most` (a process-mode `trainer/ckpt-N`, or a
    resident trainer's `trainer/full-N`) and its iteration; (None, 0) when there is none: the base model."""
    for key in (layout.checkpoint(run, at_most), layout.full_checkpoint(run, at_most)):   # the common cases
        manifest = store.manifest(key) if at_most > 0 else None
        if manifest is not None and manifest["meta"].get("kind", "full") == "full":
            return key, at_most
    found = []
    for name in store.list_folders(f"{run}/trainer"):
        kind, _, number = name.partition("-")
        if kind in ("ckpt", "full") and number.isdigit() and int(number) <= at_most:
            found.append((int(number), kind == "full", f"{run}/trainer/{name}"))
    for iteration, _, key in sorted(found, reverse=True):
        manifest = store.manifest(key)
        if manifest is not None and manifest["meta"].get("kind", "full") == "full":
            return key, iteration
    return None, 0


def restore(cfg: Config, store: Store, iteration: int) -> TrainingEngine:
    """An engine holding the trainer's state after iteration `iteration` (0: the base model): the newest full
    checkpoint at or before it, then the iterations after it replayed from their stored rewards. The last
    replayed iteration must reproduce the policy that iteration published, bit for bit on a CPU (checked: the
    weights carry every earlier step, so a divergence anywhere shows there; checking each one would write and
    hash a policy per replayed iteration, up to train.checkpoint_every - 1 of them)."""
    key, at = newest_full(store, cfg.run.name, iteration)
    engine = training_engine(cfg).open(cfg, store, key)
    try:
        for k in range(at + 1, iteration + 1):
            update(engine, cfg, store, k)
        if iteration > at:
            _check_replay(engine, store, layout.checkpoint(cfg.run.name, iteration))
    except BaseException:
        engine.close()
        raise
    return engine


def _check_replay(engine: TrainingEngine, store: Store, key: str) -> None:
    manifest = store.manifest(key)
    if manifest is None:
        raise RuntimeError(f"replay: {store.uri(key)} is missing; the stored iterations are incomplete")
    with tempfile.TemporaryDirectory(prefix="rlflow-replay-") as tmp:
        engine.save_policy(Path(tmp))
        if engine.rank != 0:
            return
        mine = {rel: sha256_file(Path(tmp) / rel) for rel in _weight_files(Path(tmp))}
    theirs = {rel[len(layout.CKPT_MODEL) + 1:]: f["sha256"] for rel, f in manifest["files"].items()
              if rel.startswith(layout.CKPT_MODEL + "/") and rel.endswith(".safetensors")}
    if mine != theirs:
        message = (f"replay: iteration {manifest['meta'].get('iteration')} reproduced other weights than "
                   f"{store.uri(key)} holds")
        if engine.device.type == "cpu":
            raise RuntimeError(message + " (on a CPU replay is exact: this is a bug)")
        warnings.warn(message + " (GPU kernels are not bit-reproducible; training goes on from the replay)",
                      stacklevel=2)


def _weight_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.safetensors"))

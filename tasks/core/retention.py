"""Retention (`store.keep`): which of a run's checkpoints and policies its lease holder deletes.

    doomed = plan(store, cfg, protected={"run/policy/v000012"})     # folder keys, nothing deleted yet
    apply(store, cfg, protected)                                      # deletes them (manifest first)

Kept whatever the settings say, because a resume or a user needs them:
  - the two newest `trainer/ckpt-N` (train N+1 names ckpt-N; a resume re-checks the last iteration, whose train
    names ckpt-(N-1); one from further back, MLflow lagging, takes a ckpt-N without its input: tasks/train.py);
  - every checkpoint after the newest full one (a resident trainer that was lost replays those iterations and
    checks each against its checkpoint), and the newest full checkpoint itself;
  - the policies `policy/LATEST` and `policy/BEST` name, every evaluated policy (`eval/vN` exists), the
    `protected` ones (the MLflow champion), each kept delta's full policy, and v0 (a warm start's result);
  - rollouts and rewards (small, and what a replay reads).
A full checkpoint is a process-mode `trainer/ckpt-N` or a resident trainer's `trainer/full-N`; a deleted
DeepSpeed checkpoint takes its node folders (trainer-state/…) with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tasks.core import layout

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store


def _numbered(names: list[str], prefix: str) -> dict[int, str]:
    return {int(n[len(prefix):]): n for n in names if n.startswith(prefix) and n[len(prefix):].isdigit()}


def _newest(numbers: list[int], last: int, every: int) -> set[int]:
    kept = set(sorted(numbers)[-last:]) if last else set(numbers)
    return kept | ({n for n in numbers if n % every == 0} if every else set())


def plan(store: Store, cfg: Config, protected: set[str] = frozenset()) -> list[str]:
    """The folder keys `apply` would delete (checkpoints first, then policies)."""
    run, keep = cfg.run.name, cfg.store.keep
    trainer = store.list_folders(f"{run}/trainer")
    kinds = {}                                              # ckpt-N: full (process mode) or lean (resident)
    for it in _numbered(trainer, "ckpt-"):
        manifest = store.manifest(layout.checkpoint(run, it))
        if manifest is not None:                            # (a half-written one is staging clean-up's)
            kinds[it] = manifest["meta"].get("kind", "full")
    fulls = [it for it in _numbered(trainer, "full-") if store.manifest(layout.full_checkpoint(run, it))]
    full_its = sorted({it for it, kind in kinds.items() if kind == "full"} | set(fulls))
    newest_full = full_its[-1] if full_its else 0
    kept_full = _newest(full_its, keep.checkpoints_last, keep.checkpoints_every) | {newest_full}
    kept_ckpt = set(sorted(kinds)[-2:]) | {it for it in kinds if it > newest_full}
    doomed = [layout.checkpoint(run, it) for it, kind in sorted(kinds.items())
              if it not in kept_ckpt and (kind == "lean" or it not in kept_full)]
    doomed += [layout.full_checkpoint(run, it) for it in sorted(fulls) if it not in kept_full]

    versions = sorted(_numbered(store.list_folders(f"{run}/policy"), "v"))
    kept = _newest(versions, keep.policies_last, keep.policies_every)
    kept |= set(_numbered(store.list_folders(f"{run}/eval"), "v")) | ({0} & set(versions))
    for pointer in (layout.latest(run, "policy"), layout.best(run)):
        if target := store.get_pointer(pointer):
            protected = {*protected, target}
    kept |= {v for v in versions if layout.policy(run, v) in protected}
    for v in sorted(kept & set(versions)):                  # the full policy a delta is rebuilt from
        manifest = store.manifest(layout.policy(run, v))
        if manifest is not None and (anchor := manifest["meta"].get("anchor")):
            kept.add(layout.version_of(anchor))
    doomed += [layout.policy(run, v) for v in versions if v not in kept]
    return doomed


def _names_its_own(store: Store, pointer: str, target: str) -> bool:
    """Whether `target` is a complete folder beside `pointer` (policy/LATEST: a policy of this run's); one whose
    manifest is corrupt counts (flows/repair.py makes it again where it is read)."""
    return target.startswith(pointer.rsplit("/", 1)[0] + "/") and _complete(store, target, corrupt=True)


def mend_pointers(store: Store, cfg: Config) -> list[str]:
    """Make again the run's pointers that are not pointers any more (a truncated or edited file: every reader of
    it failed, retention and the resume first), or that name no complete folder of theirs (edited to a version
    that is not there, or another run's: left so after the run): policy/LATEST and trainer/LATEST name the
    newest complete folder of theirs, BEST the evaluated policy with the best eval.metric above the starting
    model's (ties: the earlier). What was mended, said as lines. Only the lease holder calls this, before
    anything reads them."""
    from tasks.core.store import CorruptArtifact

    run, said = cfg.run.name, []
    newest = {layout.latest(run, "policy"): (f"{run}/policy", "v", layout.policy),
              layout.latest(run, "trainer"): (f"{run}/trainer", "ckpt-", layout.checkpoint)}
    for pointer in (*newest, layout.best(run)):
        try:
            if (at := store.get_pointer(pointer)) is None or _names_its_own(store, pointer, at):
                continue
            bad = f"{store.uri(pointer)}: points at {at}, not a complete folder of its own"     # (edited)
        except CorruptArtifact as e:
            bad = str(e)
        if pointer in newest:
            folder, prefix, key_of = newest[pointer]
            target = next((key_of(run, n) for n in sorted(_numbered(store.list_folders(folder), prefix),
                                                          reverse=True) if store.manifest(key_of(run, n)) is not None),
                          None)                  # (the newest complete one: the manifests read from the newest down)
        else:
            target = _best(store, cfg)
        if target is not None:
            store.set_pointer(pointer, target)
        else:
            store.delete_pointer(pointer)
        said.append(f"{bad}: made again, pointing at {store.uri(target) if target else 'nothing yet'}")
    return said


def improves(score: float, best: float | None, floor: float | None) -> bool:
    """BEST's rule: a policy's score takes BEST when it beats the base model's (eval.baseline's, when it was
    evaluated) and the best so far, both strictly (a tie keeps the earlier policy). tasks/evaluate.py moves
    BEST by it as each evaluation ends; _best makes BEST again by it from all of them."""
    return (floor is None or score > floor) and (best is None or score > best)


def _complete(store: Store, key: str, corrupt: bool) -> bool:
    """Whether folder `key` has its manifest; `corrupt`: the answer where that manifest is corrupt."""
    from tasks.core.store import CorruptArtifact

    try:
        return store.manifest(key) is not None
    except CorruptArtifact:
        return corrupt


def _best(store: Store, cfg: Config) -> str | None:
    """The policy BEST names, from the run's evaluations (improves), among the policies still complete (one
    quarantined whose remaking failed cannot be pointed at)."""
    run, name = cfg.run.name, cfg.eval.metric_key()
    found = {n: store.manifest(layout.evaluation(run, n)) for n in _numbered(store.list_folders(f"{run}/eval"), "v")}
    scores = {n: m["meta"].get("metrics", {}).get(name) for n, m in found.items() if m is not None}
    floor = scores.get(0) if cfg.eval.baseline else None
    best = None
    candidates = [k for k, v in scores.items() if k > 0 and v is not None]
    for n in sorted(k for k in candidates if _complete(store, layout.policy(run, k), corrupt=False)):
        if improves(scores[n], scores[best] if best is not None else None, floor):
            best = n
    return layout.policy(run, best) if best is not None else None


def apply(store: Store, cfg: Config, protected: set[str] = frozenset()) -> int:
    """Delete what `plan` names (each folder's manifest first, so no reader sees a partial folder as complete),
    with a deleted DeepSpeed checkpoint's node folders. Returns how many folders went. Only the lease holder
    calls this, when no stage of the run is running."""
    doomed = plan(store, cfg, protected)
    for key in doomed:
        manifest = store.manifest(key)
        parts = []
        if manifest is not None and layout.CKPT_STATE in manifest["files"]:
            parts = store.get_json(key, layout.CKPT_STATE).get("engine_state", [])
        store.delete_folder(key)
        for part in parts:
            store.delete_folder(part)
    return len(doomed)


def holds_no_iteration(store: Store, run: str) -> bool:
    """The store holds no iteration of `run`: no policy past v0 published, no rewards of iteration 1 (a folder
    there that does not read is one): an MLflow run that logged some was an earlier run's (Tracker.start)."""
    from tasks.core.artifacts import IncompleteArtifact
    from tasks.core.errors import UserError

    try:
        latest = store.get_pointer(layout.latest(run, "policy"))
        return not (latest and layout.version_of(latest)) and store.manifest(layout.rewards(run, 1)) is None
    except (IncompleteArtifact, UserError):
        return False

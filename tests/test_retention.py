"""Retention (store.keep, tasks/core/retention.py) on a file store laid out as runs leave it: what goes, and
that nothing a resume or a user needs ever does."""

from __future__ import annotations

import json

import pytest

from tasks.core import layout, retention
from tasks.core.config import load_config
from tasks.core.store import CorruptArtifact, Store
from tests.conftest import TINY


def _folder(store, tmp_path, key: str, meta: dict | None = None, state: dict | None = None) -> None:
    src = tmp_path / "src" / key
    src.mkdir(parents=True)
    (src / "x.bin").write_bytes(key.encode())
    if state is not None:
        (src / layout.CKPT_STATE).write_text(json.dumps(state))
    store.put_folder(key, src, meta=meta or {})


def _cfg(tmp_path, **keep):
    return load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=r",
                              *(f"store.keep.{k}={v}" for k, v in keep.items())])


@pytest.fixture
def store(tmp_path):
    return Store.open(str(tmp_path / "store"))


def test_process_mode_keeps_the_newest_checkpoints_and_every_needed_policy(store, tmp_path):
    for it in range(1, 9):
        _folder(store, tmp_path, layout.checkpoint("r", it), state={"iteration": it})     # full (process mode)
        _folder(store, tmp_path, layout.policy("r", it))
    for it in (2, 4):
        _folder(store, tmp_path, layout.evaluation("r", it))
    store.set_pointer(layout.latest("r", "policy"), layout.policy("r", 8))
    store.set_pointer(layout.best("r"), layout.policy("r", 4))
    cfg = _cfg(tmp_path, checkpoints_last=3, checkpoints_every=5, policies_last=2)
    doomed = retention.plan(store, cfg, protected={layout.policy("r", 1)})            # the MLflow champion
    assert doomed == [layout.checkpoint("r", it) for it in (1, 2, 3, 4)] + \
        [layout.policy("r", it) for it in (3, 5, 6)]
    assert retention.apply(store, cfg, protected={layout.policy("r", 1)}) == 7
    assert [store.manifest(layout.checkpoint("r", it)) is not None for it in range(1, 9)] == \
        [False] * 4 + [True] * 4
    assert retention.plan(store, cfg, protected={layout.policy("r", 1)}) == []         # nothing more to do


def test_resident_mode_keeps_what_a_replay_needs(store, tmp_path):
    """Lean ckpt-N every iteration, full-N every 3: the newest full checkpoint and every lean one after it stay
    (a lost trainer replays them), older lean ones and fulls beyond checkpoints_last go."""
    for it in range(1, 9):
        _folder(store, tmp_path, layout.checkpoint("r", it), meta={"kind": "lean"}, state={"iteration": it})
        _folder(store, tmp_path, layout.policy("r", it))
    for it in (3, 6):
        _folder(store, tmp_path, layout.full_checkpoint("r", it), meta={"kind": "full"}, state={"iteration": it})
    _folder(store, tmp_path, "r/trainer/full-000009")          # half-written: no manifest is left out ...
    store._delete(f"r/trainer/full-000009/{'MANIFEST.json'}")  # ... (staging clean-up's business)
    cfg = _cfg(tmp_path, checkpoints_last=1)
    assert retention.plan(store, cfg) == [layout.checkpoint("r", it) for it in range(1, 7)] + \
        [layout.full_checkpoint("r", 3)]        # a replay from full-6 checks against ckpt-7, ckpt-8 only
    cfg = _cfg(tmp_path, checkpoints_last=0)                   # 0 = keep every full checkpoint
    assert layout.full_checkpoint("r", 3) not in retention.plan(store, cfg)


def test_a_deleted_deepspeed_checkpoint_takes_its_node_folders(store, tmp_path):
    parts = {}
    for it in (1, 2, 3):
        node = layout.engine_state("r", it, "a1", 0)
        _folder(store, tmp_path, node)
        parts[it] = node
        _folder(store, tmp_path, layout.checkpoint("r", it), state={"iteration": it, "engine_state": [node]})
    retention.apply(store, _cfg(tmp_path, checkpoints_last=1))
    assert store.manifest(parts[1]) is None and store.manifest(parts[2]) is not None   # 2: the one before 3
    assert store.manifest(parts[3]) is not None


def test_a_resume_that_walks_again_from_mlflows_last_iteration_takes_checkpoints_whose_input_retention_removed(
        tmp_path):
    """MLflow's tracker flushes behind the store, so a killed run resumes from an iteration before its newest
    published one, while retention (at the flow's start) has kept only the newest checkpoints: train of that
    iteration found its input ckpt-(N-1) gone, and the run could never resume. ckpt-N made from this config is
    taken as it is; made from another config, the missing input is named as before."""
    from tasks.core.errors import UserError
    from tasks.generate import generate
    from tasks.publish import publish
    from tasks.reward import reward
    from tasks.train import train

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=r", "train.mode=process", "eval.every=0"])
    done = {}
    for it in (1, 2, 3):
        generate(cfg, it, layout.behaviour_policy("r", it, 0))
        reward(cfg, it)
        done[it] = train(cfg, it)
        publish(cfg, it)
    Store.open(str(tmp_path / "store")).delete_folder(layout.checkpoint("r", 1))     # (as retention does)
    again = train(cfg, 2)
    assert again["key"] == done[2]["key"] and again["metrics"] == done[2]["metrics"]
    other = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=r", "train.mode=process", "eval.every=0",
                               "train.lr=0.5"])
    with pytest.raises(UserError, match="no complete checkpoint of iteration 1"):
        train(other, 2)
    # a published policy taken again (a resume's walk, a complete run checked) is checked byte for byte
    weights = tmp_path / "store" / "r" / "policy" / "v000003" / "model.safetensors"
    flipped = bytearray(weights.read_bytes())
    flipped[len(flipped) // 2] ^= 0x10
    weights.write_bytes(bytes(flipped))
    with pytest.raises(CorruptArtifact, match="v000003/model.safetensors: sha256 does not match"):
        publish(cfg, 3)


def test_pointers_that_are_not_pointers_any_more_are_made_again(store, tmp_path):
    cfg = _cfg(tmp_path)
    for it in range(1, 4):
        _folder(store, tmp_path, layout.checkpoint("r", it), state={"iteration": it})
        _folder(store, tmp_path, layout.policy("r", it))
    for it, score in ((0, 0.2), (1, 0.5), (2, 0.7), (3, 0.7)):
        _folder(store, tmp_path, layout.evaluation("r", it), meta={"metrics": {cfg.eval.metric_key(): score}})
    for pointer in (layout.latest("r", "policy"), layout.latest("r", "trainer"), layout.best("r")):
        (tmp_path / "store" / pointer).write_text('{"target": "r/pol')          # (cut short)
    with pytest.raises(CorruptArtifact):
        retention.plan(store, cfg)
    said = retention.mend_pointers(store, cfg)
    assert len(said) == 3 and all("not a pointer" in line for line in said)
    assert store.get_pointer(layout.latest("r", "policy")) == layout.policy("r", 3)
    assert store.get_pointer(layout.latest("r", "trainer")) == layout.checkpoint("r", 3)
    assert store.get_pointer(layout.best("r")) == layout.policy("r", 2)       # (ties: the earlier)
    assert retention.mend_pointers(store, cfg) == []


def test_pointers_that_name_no_complete_folder_of_their_own_are_made_again(store, tmp_path):
    """policy/LATEST edited to a version that is not there, or to another run's policy, was left so after the
    run (advance_pointer never moves a pointer back; mend_pointers mended only what did not parse)."""
    cfg = _cfg(tmp_path)
    for it in range(1, 4):
        _folder(store, tmp_path, layout.checkpoint("r", it), state={"iteration": it})
        _folder(store, tmp_path, layout.policy("r", it))
    _folder(store, tmp_path, layout.policy("other", 3))
    for target in (layout.policy("r", 9), layout.policy("other", 3)):
        (tmp_path / "store" / layout.latest("r", "policy")).write_text(json.dumps({"target": target}))
        store.set_pointer(layout.latest("r", "trainer"), layout.checkpoint("r", 3))
        said = retention.mend_pointers(store, cfg)
        assert len(said) == 1 and f"points at {target}, not a complete folder of its own" in said[0], said
        assert store.get_pointer(layout.latest("r", "policy")) == layout.policy("r", 3)
    assert retention.mend_pointers(store, cfg) == []


def test_best_is_made_again_among_the_policies_still_there(store, tmp_path):
    """BEST named a policy quarantined (its remaking failed): mending it chose that policy again from the
    evaluations, and set_pointer refused it (IncompleteArtifact, a traceback at resume)."""
    cfg = _cfg(tmp_path)
    for it in range(1, 3):
        _folder(store, tmp_path, layout.policy("r", it))
    for it, score in ((1, 0.5), (2, 0.7)):
        _folder(store, tmp_path, layout.evaluation("r", it), meta={"metrics": {cfg.eval.metric_key(): score}})
    store.set_pointer(layout.best("r"), layout.policy("r", 2))
    store.quarantine(layout.policy("r", 2))
    said = retention.mend_pointers(store, cfg)
    assert any("BEST: points at r/policy/v000002" in line for line in said), said
    assert store.get_pointer(layout.best("r")) == layout.policy("r", 1)


def test_an_output_whose_manifest_was_edited_is_made_again_by_its_stage(tmp_path):
    """iter-1/rewards' manifest edited (its fingerprint): the reward stage's reuse finds it corrupt, Repair moves it
    to quarantine and the stage makes it again, the same bytes; it was a refusal blaming the config."""
    from types import SimpleNamespace

    from flows.repair import Repair
    from flows.training import STAGE_FUNCTIONS
    from tasks.core import rollout
    from tasks.generate import generate
    from tasks.reward import reward

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=ed", "generate.prompts_per_iteration=2",
                             "generate.num_generations=2"])
    generate(cfg, 1, layout.BASE)
    reward(cfg, 1)
    store, key = Store.open(cfg.store), layout.rewards("ed", 1)
    made = store.manifest(key)["files"][rollout.FILE]["sha256"]
    manifest = tmp_path / "store" / key / "MANIFEST.json"
    edited = json.loads(manifest.read_text())
    edited["meta"]["fingerprint"] = "0" * 16
    manifest.write_text(json.dumps(edited))
    said = []
    repair = Repair(lambda name, it, ctx, *a, **k: STAGE_FUNCTIONS[name](cfg, it, *a, **k),
                    SimpleNamespace(cfg=cfg, store=store), SimpleNamespace(warning=said.append))
    repair.note = said.append
    assert repair("reward", 1, None)["key"] == key
    assert store.manifest(key)["files"][rollout.FILE]["sha256"] == made
    assert len(said) == 2 and "its manifest's fingerprint is not that of what it says" in said[0]
    assert said[0].endswith("making it again (reward of iteration 1)")
    assert [k.split("-")[0] for k in store.list_folders("ed/quarantine/iter-000001")] == ["rewards"], \
        store.list_folders("ed/quarantine/iter-000001")


def test_a_resume_whose_mlflow_lags_past_the_kept_checkpoints_goes_on_and_logs_what_it_lacked(prefect_api, tmp_path):
    """A kill right after the last publish, MLflow's tracker three iterations behind (it flushes behind the
    store), retention keeping the two newest checkpoints: the resume walked again from MLflow's last iteration,
    whose train needed checkpoints retention had removed (`no complete checkpoint of iteration 2`, every time: the
    run could never be resumed). Now it walks from the first iteration it can train again and logs the ones
    before from what the store keeps: every iteration's reward/mean is in MLflow once."""
    import sqlite3

    from mlflow.tracking import MlflowClient

    from tests.conftest import read_summary, run_cli

    db = tmp_path / "mlflow.db"
    args = ["run", str(TINY), "-o", "run.name=lag", "-o", "run.iterations=5", "-o", "eval.every=0",
            "-o", "generate.prompts_per_iteration=4", "-o", "generate.num_generations=4",
            "-o", f"tracking.uri=sqlite:///{db}", "-o", f"store.uri={tmp_path}/store", "--summary-json", "s.json"]
    first = run_cli(args, tmp_path, prefect_api)
    assert first.returncode == 0, first.stderr[-3000:]
    store = Store.open(str(tmp_path / "store"))
    assert [it for it in range(1, 6) if store.manifest(layout.checkpoint("lag", it))] == [4, 5]
    with sqlite3.connect(db) as c:                     # (MLflow as the kill left it: iterations 3-5 not flushed)
        c.execute("DELETE FROM metrics WHERE step > 2")
    again = run_cli(args, tmp_path, prefect_api)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "iterations 3-3: logged to MLflow from the store" in again.stdout + again.stderr
    run_id = read_summary(tmp_path / "s.json")["mlflow_run_id"]
    steps = [m.step for m in MlflowClient(f"sqlite:///{db}").get_metric_history(run_id, "reward/mean")]
    assert sorted(steps) == [1, 2, 3, 4, 5], steps

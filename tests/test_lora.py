"""LoRA: only the adapter trains; checkpoints and published policies hold the adapter alone (a few hundred KB
here); the generator loads base + adapter and reproduces the trainer's logprobs; resume stays exact."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.models import base_path, load_model
from tasks.core.paths import cache_root
from tasks.core.store import Store
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import finish_trainer, train
from tests.conftest import AT_LENGTH, TINY


def _cfg(tmp_path, name: str, extra=()):
    return load_config(TINY, [f"store.uri={tmp_path}/store", f"run.name={name}", "generate.prompts_per_iteration=4",
                              "generate.num_generations=4", "train.lora_r=4", "train.lr=5e-2",
                              'reward.functions=[{"fn": "tasks.rewards.demo:stops_reward"}]', *extra])


def _iteration(cfg, it: int) -> dict:
    generate(cfg, it, layout.BASE if it == 1 else layout.policy(cfg.run.name, it - 1))
    reward(cfg, it)
    t = train(cfg, it)
    publish(cfg, it)
    return t


def test_only_the_adapter_trains_and_is_published(tmp_path):
    cfg = _cfg(tmp_path, "lora", ["train.beta=0.05"])
    for it in (1, 2):
        metrics = _iteration(cfg, it)["metrics"]
    assert metrics["train/kl_ref"] > 0                       # reference = base with the adapter disabled
    # Policy v1 was trained by ckpt-1 and generated iteration 2: same adapter, same logprobs.
    assert metrics["train/mismatch_kl"] < 1e-6
    store = Store.open(cfg.store)
    ckpt = {f.removeprefix("model/") for f in store.manifest(layout.checkpoint("lora", 2))["files"]
            if f.startswith("model/")}
    published = set(store.manifest(layout.policy("lora", 2))["files"])
    for files in (ckpt, published):
        assert "adapter_model.safetensors" in files and "model.safetensors" not in files
    store.get_folder(layout.policy("lora", 2), tmp_path / "pub")
    adapter = load_file(tmp_path / "pub" / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter)
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in adapter.items())   # it moved from 0
    base = load_model(base_path(cfg)).state_dict()
    from tasks.core.models import load_policy
    loaded = load_policy(cfg, str(tmp_path / "pub"), "cpu").merge_and_unload().state_dict()
    changed = [k for k in base if not torch.equal(base[k], loaded[k])]
    assert changed and all(k.endswith(("proj.weight",)) for k in changed)   # only adapted linears differ


def test_resume_with_lora_and_several_passes_is_exact(tmp_path):
    """Process mode: each iteration restores from the previous full checkpoint, also on a fresh machine."""
    extra = ["train.num_iterations=3", "train.mode=process"]
    straight = _cfg(tmp_path / "a", "r", extra)
    for it in (1, 2, 3):
        _iteration(straight, it)
    resumed = _cfg(tmp_path / "b", "r", extra)
    for it in (1, 2):
        _iteration(resumed, it)
    shutil.rmtree(cache_root() / "store", ignore_errors=True)    # a fresh machine: nothing local survives
    _iteration(resumed, 3)
    a = Store.open(straight.store).manifest(layout.checkpoint("r", 3))["files"]
    b = Store.open(resumed.store).manifest(layout.checkpoint("r", 3))["files"]
    for name in ("model/adapter_model.safetensors", "optimizer.pt"):
        assert a[name]["sha256"] == b[name]["sha256"], name


@AT_LENGTH                      # (make test keeps test_resume_with_lora_and_several_passes_is_exact)
def test_a_resident_lora_trainer_killed_midway_publishes_what_process_mode_does(tmp_path, monkeypatch):
    """Resident mode keeps the adapter and its optimizer in memory, writes lean (adapter-only) checkpoints and
    full ones every 2; killed before iteration 3's write, it restores full-2 and replays: same adapters."""
    extra = ["train.num_iterations=2", "train.checkpoint_every=2"]
    process = _cfg(tmp_path / "p", "lp", [*extra, "train.mode=process"])
    resident = _cfg(tmp_path / "r", "lr", [*extra, "train.mode=resident", "train.host=detached"])
    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    for it in (1, 2, 3, 4):
        _iteration(process, it)
        generate(resident, it, layout.BASE if it == 1 else layout.policy("lr", it - 1))
        reward(resident, it)
        try:
            train(resident, it)
        except RuntimeError:                    # the trainer died: what the flow's retry does
            train(resident, it)
        publish(resident, it)
    assert (tmp_path / "drilled").exists()
    for it in (1, 2, 3, 4):
        a, b = (Store.open(c.store).manifest(layout.policy(c.run.name, it))["files"]["adapter_model.safetensors"]
                for c in (process, resident))
        assert a["sha256"] == b["sha256"], it
    assert finish_trainer(resident) == 4

"""Policies that travel light (tasks/core/policy.py): sparse deltas against a whole anchor, rebuilt exactly and
checked; published by the publish stage where smaller; read by the generators as if whole; exported whole."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.policy import DELTA_FILE, DELTA_INDEX, encode, materialize, write_delta
from tasks.core.store import IncompleteArtifact, Store
from tests.conftest import TINY


def _policy(folder, tensors: dict) -> None:
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))


def test_a_delta_rebuilds_the_exact_tensors_and_refuses_a_changed_byte(tmp_path):
    torch.manual_seed(0)
    old = {"w": torch.randn(64, 64).to(torch.bfloat16), "b": torch.randn(64).to(torch.bfloat16),
           "gone": torch.zeros(3)}
    new = {"w": old["w"].clone(), "b": old["b"].clone(), "grown": torch.ones(5, dtype=torch.bfloat16)}
    new["w"][3, :7] += 1.0                                              # a few weights move, the rest keep their bits
    new["b"][0] = -0.0 if old["b"][0] == 0 else -old["b"][0]
    store = Store.open(str(tmp_path / "store"))
    _policy(tmp_path / "anchor", old)
    _policy(tmp_path / "new", new)
    store.put_folder("r/policy/v000001", tmp_path / "anchor")
    delta = encode(tmp_path / "new", tmp_path / "anchor")
    assert delta is not None and delta.size < delta.whole / 10
    (tmp_path / "out").mkdir()
    write_delta(delta, tmp_path / "new", tmp_path / "out", "r/policy/v000001")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", DELTA_INDEX, DELTA_FILE]
    store.put_folder("r/policy/v000002", tmp_path / "out", meta={"anchor": "r/policy/v000001"})
    rebuilt = load_file(materialize(store, "r/policy/v000002") / "model.safetensors")
    assert rebuilt.keys() == new.keys() and all(torch.equal(rebuilt[k].view(torch.int16), new[k].view(torch.int16))
                                                for k in ("w", "b", "grown"))
    assert materialize(store, "r/policy/v000002") == materialize(store, "r/policy/v000002")    # rebuilt once

    tampered = load_file(tmp_path / "out" / DELTA_FILE)
    tampered["model.safetensors::w::val"][0] += 1
    save_file(tampered, tmp_path / "out" / DELTA_FILE, metadata={"format": "rlflow-delta"})
    store.put_folder("r/policy/v000003", tmp_path / "out", meta={"anchor": "r/policy/v000001"})
    with pytest.raises(IncompleteArtifact, match="tensor w of model.safetensors"):
        materialize(store, "r/policy/v000003")


def test_no_delta_when_it_would_not_be_smaller(tmp_path):
    _policy(tmp_path / "a", {"w": torch.randn(32, 32)})
    _policy(tmp_path / "b", {"w": torch.randn(32, 32)})                 # every weight changed
    assert encode(tmp_path / "b", tmp_path / "a") is None


def test_the_sample_skips_a_dense_change_without_a_whole_comparison_and_never_a_sparse_one(tmp_path, monkeypatch):
    """fp32 weights after an Adam step all move: a few sampled rows say so, and the files are never loaded
    whole. A sparse change the sample misses is still found by the whole comparison."""
    import tasks.core.policy as policy

    w, b = torch.randn(256, 64), torch.randn(64)
    _policy(tmp_path / "a", {"w": w, "b": b})
    _policy(tmp_path / "dense", {"w": w + 1e-6 * torch.randn(256, 64).sign(), "b": torch.randn(64)})
    sparse = w.clone()
    sparse[1, 5] += 1.0                                                  # row 1: not one of the sampled rows
    _policy(tmp_path / "sparse", {"w": sparse, "b": b})
    loads = []
    monkeypatch.setattr(policy, "load_file", lambda path: loads.append(path) or load_file(path))
    assert encode(tmp_path / "dense", tmp_path / "a") is None and loads == []
    delta = encode(tmp_path / "sparse", tmp_path / "a")
    assert delta is not None and delta.tensors["model.safetensors::w::idx"].tolist() == [1 * 64 + 5]


@pytest.mark.slow
def test_delta_policies_generate_what_whole_ones_do_and_export_whole(tmp_path):
    """bf16 policies at a small learning rate: v2 and v4 go out as deltas (v3 is an anchor), the next
    iterations sample exactly what a run with every policy whole samples, and `rlflow export` writes v4 whole."""
    from flows.cli import main
    from tasks.generate import generate
    from tasks.publish import publish
    from tasks.reward import reward
    from tasks.train import train

    def run(name: str, anchor_every: int):
        cfg = load_config(TINY, [f"store.uri={tmp_path}/store", f"run.name={name}", "publish.dtype=bfloat16",
                                 f"publish.anchor_every={anchor_every}", "train.lr=1e-5", "publish.delta=always",
                                 "generate.prompts_per_iteration=4", "generate.num_generations=4"])
        for it in range(1, 6):
            generate(cfg, it, layout.BASE if it == 1 else layout.policy(name, it - 1))
            reward(cfg, it)
            train(cfg, it)
            publish(cfg, it)
        return cfg

    deltas, whole = run("deltas", 3), run("whole", 1)
    store = Store.open(str(tmp_path / "store"))
    anchors = [store.manifest(layout.policy("deltas", it))["meta"].get("anchor") for it in range(1, 6)]
    assert anchors == [None, "deltas/policy/v000001", None, "deltas/policy/v000003", "deltas/policy/v000003"]
    assert all(store.manifest(layout.policy("whole", it))["meta"].get("anchor") is None for it in range(1, 6))
    for it in range(2, 6):                                   # sampled from rebuilt policies v1..v4: the same
        a, b = (store.manifest(layout.rollouts(n, it))["files"]["rollouts.jsonl"]["sha256"]
                for n in ("deltas", "whole"))
        assert a == b, it
    v4 = store.manifest(layout.policy("deltas", 4))
    assert DELTA_FILE in v4["files"] and v4["meta"]["metrics"]["publish/delta_share"] < 0.5
    out = tmp_path / "exported"
    overrides = [f"store.uri={tmp_path}/store", "run.name=deltas"]
    assert main(["export", str(TINY), "4", str(out), *sum((["-o", o] for o in overrides), [])]) == 0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    reference = load_file(materialize(store, layout.policy("whole", 4)) / "model.safetensors")
    for name, t in model.state_dict().items():
        if name in reference:
            assert torch.equal(t.view(torch.int16), reference[name].view(torch.int16)), name
    assert main(["export", str(TINY), "4", str(out), *sum((["-o", o] for o in overrides), [])]) == 2   # not empty
    assert deltas.run.name == "deltas" and whole.run.name == "whole"


def test_the_hf_engine_loads_a_next_policy_in_place_exactly(tmp_path):
    """An inline generate keeps its model and loads the next policy's weights into it: the same tensors as a
    fresh from_pretrained, bit for bit (bf16 weights into the fp32 model, tied embeddings included)."""
    from tasks.core.builtin_models import resolve
    from tasks.core.models import load_model
    from tasks.engines import hf

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store"])
    base = load_model(resolve("builtin:tiny-lm"))
    folders = []
    for i in range(2):
        torch.manual_seed(i)
        with torch.no_grad():
            for p in base.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        folders.append(tmp_path / f"v{i}")
        base.to(torch.bfloat16).save_pretrained(folders[-1])
        base.float()
    with hf.HFEngine(cfg).session("v0", str(folders[0]), None):
        first = hf.RESIDENT.model
    with hf.HFEngine(cfg).session("v1", str(folders[1]), None):
        second = hf.RESIDENT.model
    assert second is first                                            # in place
    fresh = load_model(str(folders[1]))
    mine, theirs = second.state_dict(), fresh.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_an_hf_session_loads_its_policy_once_for_all_its_samples(tmp_path, monkeypatch):
    """A session is opened for a policy and sampled from many times (every turn of an episode, evaluate's two
    passes): a model is built into the resident once, and kept for the next stage's session until the engine
    stops or another kind of model is asked for (here: base, adapter, base). What a sample draws depends on its
    seed alone."""
    from tasks.core.builtin_models import resolve
    from tasks.core.contracts import SamplingParams
    from tasks.core.models import add_lora, load_model, load_policy, load_tokenizer
    from tasks.engines import hf

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "train.lora_r=4"])
    base = resolve("builtin:tiny-lm")
    adapter = str(tmp_path / "adapter")
    add_lora(load_model(base), cfg.train).save_pretrained(adapter)
    tok = load_tokenizer(base)
    built = []
    monkeypatch.setattr(hf, "load_policy", lambda *a, **k: built.append(a[1]) or load_policy(*a, **k))
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(n=2, max_new_tokens=4, temperature=1.0, top_p=1.0, seed=7)
    hf.RESIDENT.release()
    drawn = {}
    for path in (base, adapter, base):                      # (the third: the next stage's session)
        with hf.HFEngine(cfg).session("p", path, tok) as session:
            samples = [session.sample(prompts, params).samples for _ in range(3)]
        assert samples[1] == samples[0] == samples[2] == drawn.setdefault(path, samples[0])
    assert built == [base, adapter, base]
    hf.HFEngine(cfg).stop()
    assert hf.RESIDENT.model is None


def test_the_hf_engine_loads_a_next_adapter_in_place_exactly(tmp_path):
    """A LoRA run's policies are adapters on one base: the resident keeps base + adapter and loads the next
    adapter's weights into it (the base's untouched), giving the logits a fresh base + adapter gives, bit for
    bit; an adapter of another shape (its config) is built anew."""
    from tasks.core.builtin_models import resolve
    from tasks.core.models import add_lora, load_model, load_policy
    from tasks.engines import hf

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "train.lora_r=4"])
    wider = load_config(TINY, [f"store.uri={tmp_path}/store", "train.lora_r=8"])
    folders = []
    for i, c in enumerate([cfg, cfg, wider]):
        torch.manual_seed(i)
        model = add_lora(load_model(resolve("builtin:tiny-lm")), c.train)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn_like(p) * 0.1)          # (B too: a fresh adapter's B is 0)
        folders.append(str(tmp_path / f"a{i}"))
        model.save_pretrained(folders[-1])
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    hf.RESIDENT.release()
    held = []
    for folder in folders:
        with hf.HFEngine(cfg).session("p", folder, None):
            held.append(hf.RESIDENT.model)
        with torch.no_grad():
            assert torch.equal(held[-1](ids).logits, load_policy(cfg, folder, "cpu").eval()(ids).logits), folder
    assert held[1] is held[0] and held[2] is not held[1]            # in place; another shape: built
    hf.HFEngine(cfg).stop()


def test_deltas_by_default_only_where_readers_download(tmp_path):
    """publish.delta auto: an S3 store (a generator elsewhere downloads each policy) gets deltas between
    anchors; a file store links whole policies from their checkpoints (a delta would only cost CPU)."""
    from tasks.publish import _anchor

    store = Store.open(str(tmp_path / "store"))
    _policy(tmp_path / "v1", {"w": torch.zeros(4)})
    store.put_folder(layout.policy("r", 1), tmp_path / "v1")
    for setting, remote, want in (("auto", False, None), ("auto", True, "r/policy/v000001"),
                                  ("always", False, "r/policy/v000001"), ("never", True, None)):
        cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "run.name=r", f"publish.delta={setting}"])
        store.remote = remote
        assert _anchor(store, cfg, 2) == want, (setting, remote)


def test_a_tokenizer_is_shared_only_between_folders_with_the_same_tokenizer_files(tmp_path):
    """Every policy folder of a run carries the same tokenizer files: built once (tasks/core/models.py)."""
    import shutil

    from tasks.core.builtin_models import resolve
    from tasks.core.models import load_tokenizer

    base = resolve(load_config(TINY).model.name_or_path)
    for name in ("a", "b", "c"):
        shutil.copytree(base, tmp_path / name)
    config = json.loads((tmp_path / "c" / "tokenizer_config.json").read_text())
    (tmp_path / "c" / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    a, b, c = (load_tokenizer(str(tmp_path / name)) for name in ("a", "b", "c"))
    assert a is b and c is not a and c.model_max_length == 7 != a.model_max_length


def test_a_delta_rebuilt_before_is_not_taken_for_another_with_the_same_uri(tmp_path):
    """The rebuilt folder was cached by the policy's URI alone: a run started over (its store folder deleted)
    published other weights under the same URI, and the generate stage and `export` took the earlier run's
    rebuilt weights, checked only against the earlier run's own index."""
    import shutil

    store = Store.open(str(tmp_path / "store"))
    got = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        old = {"w": torch.randn(64, 64).to(torch.bfloat16)}
        new = {"w": old["w"].clone()}
        new["w"][seed, :5] += 1.0
        shutil.rmtree(tmp_path / "store" / "r", ignore_errors=True)
        for name in ("anchor", "new", "out"):
            shutil.rmtree(tmp_path / name, ignore_errors=True)
        _policy(tmp_path / "anchor", old)
        _policy(tmp_path / "new", new)
        store.put_folder("r/policy/v000001", tmp_path / "anchor")
        (tmp_path / "out").mkdir()
        write_delta(encode(tmp_path / "new", tmp_path / "anchor"), tmp_path / "new", tmp_path / "out",
                    "r/policy/v000001")
        store.put_folder("r/policy/v000002", tmp_path / "out", meta={"anchor": "r/policy/v000001"})
        got.append(load_file(materialize(store, "r/policy/v000002") / "model.safetensors")["w"])
        assert torch.equal(got[-1].view(torch.int16), new["w"].view(torch.int16)), seed


def test_export_writes_only_what_the_manifest_lists_readable_and_refuses_what_it_cannot_write(tmp_path, capsys,
                                                                                            monkeypatch):
    """`rlflow export` copied the store's folder whole: a file the manifest does not list (unverified) went out,
    the weights kept safetensors' 0600, a failed copy left its `.partial` folder; DEST a symbolic link or the
    working folder was a traceback; a delta whose anchor is gone was one; `models:/NAME/latest` was refused."""
    import shutil
    import stat

    from flows.cli import main

    store = Store.open(str(tmp_path / "store"))
    torch.manual_seed(0)
    _policy(tmp_path / "v1", {"w": torch.randn(64, 64).to(torch.bfloat16)})
    store.put_folder("r/policy/v000001", tmp_path / "v1")
    os.chmod(tmp_path / "store" / "r/policy/v000001/model.safetensors", 0o600)
    (tmp_path / "store" / "r/policy/v000001/evil.py").write_text("import os\n")        # (not in the manifest)
    args = ["-o", "run.name=r", "-o", f"store.uri={tmp_path / 'store'}"]
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(TINY), "1", "out", *args]) == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert stat.S_IMODE(os.stat(tmp_path / "out" / "model.safetensors").st_mode) & 0o044 == 0o044
    os.symlink(tmp_path / "empty", tmp_path / "link")
    (tmp_path / "empty").mkdir()
    for cwd, dest, said in ((tmp_path, "link", "DEST: link: a symbolic link"),
                            (tmp_path / "empty", ".", "DEST: .: the working folder")):
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        assert main(["export", str(TINY), "1", dest, *args]) == 2
        assert capsys.readouterr().err.startswith(f"error: {said}")
    monkeypatch.chdir(tmp_path)
    _policy(tmp_path / "new", {"w": load_file(tmp_path / "v1" / "model.safetensors")["w"].clone()})
    new = load_file(tmp_path / "new" / "model.safetensors")
    new["w"][0, :3] += 1
    save_file(new, tmp_path / "new" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "delta").mkdir()
    write_delta(encode(tmp_path / "new", tmp_path / "v1"), tmp_path / "new", tmp_path / "delta", "r/policy/v000001")
    store.put_folder("r/policy/v000002", tmp_path / "delta", meta={"anchor": "r/policy/v000001"})
    shutil.rmtree(tmp_path / "store" / "r/policy/v000001")
    capsys.readouterr()
    assert main(["export", str(TINY), "2", "out2", *args]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and "a file of the store is damaged" in err, err
    assert sorted(os.listdir(tmp_path)) == ["delta", "empty", "link", "new", "out", "store", "v1"]
    store.put_folder("other/policy/v000001", tmp_path / "v1")
    store.set_pointer(layout.latest("r", "policy"), "other/policy/v000001")     # (edited by hand)
    capsys.readouterr()
    assert main(["export", str(TINY), "latest", "out3", *args]) == 1
    assert "names other/policy/v000001, not a policy of run 'r'" in capsys.readouterr().err
    assert not (tmp_path / "out3").exists()

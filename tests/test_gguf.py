"""GGUF files as starting policies (tasks/core/gguf.py): a user's own file converts once, by transformers' own
GGUF loader, into a model folder that computes what the model it was written from computes; the folder is keyed
by the file's sha256 and the dtype; a run starts from it; a bad file is one line; the real builtin
(`builtin:smollm2-135m`, SmolLM2-135M-Instruct as Q4_1) converts and answers arithmetic.

The user's file is the builtin tiny model written here as llama.cpp writes a Llama (tests/gguf_files.py), in F32
and in Q8_0."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from tasks.core import builtin_models, gguf
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tests.conftest import TINY, read_summary, run_cli
from tests.gguf_files import write_gguf

PROMPTS = ["a=", "c=ddd", "hello world\nx = 1 + 2;", "<s>user: c=\n<s>assistant: ", "~!@#$%^&*()_+{}|:<>?"]


@pytest.fixture(scope="module")
def tiny() -> str:
    return builtin_models.resolve("builtin:tiny-lm")


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny model as GGUF files: F32 and Q8_0."""
    import gguf as gguf_py

    folder = tmp_path_factory.mktemp("gguf")
    return {"F32": write_gguf(tiny, folder / "tiny-lm.F32.gguf"),
            "Q8_0": write_gguf(tiny, folder / "tiny-lm.Q8_0.gguf", quant=gguf_py.GGMLQuantizationType.Q8_0)}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of this test's own (the session's holds the builtin models), to see everything written there."""
    root = tmp_path / "cache"
    monkeypatch.setenv("RLFLOW_CACHE", str(root))
    return root


def _logits(folder: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in prompts]


def _weights(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(folder) / "model.safetensors"))


def _leftovers(cache: Path) -> list[str]:
    """Folders under the cache's gguf/ that are not a converted model."""
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir() if not (p / "config.json").is_file()) if root.is_dir() else []


def test_a_users_f32_gguf_converts_into_the_model_it_was_written_from(tiny, files, cache):
    from transformers import AutoTokenizer

    folder = gguf.model_folder(str(files["F32"]), "float32")
    assert Path(folder).parent == cache / "gguf" and not _leftovers(cache)
    assert {"config.json", "model.safetensors", "tokenizer.json", gguf.PROVENANCE} <= {p.name for p in
                                                                                        Path(folder).iterdir()}
    config = json.loads((Path(folder) / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config                 # a plain folder: save_pretrained refuses none of it
    want = json.loads((Path(tiny) / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert config[key] == want[key], key

    # every weight as it was (q and k permuted back), so the logits are the same
    converted, original = _weights(folder), _weights(tiny)
    assert set(converted) == set(original)
    for name, t in original.items():
        assert torch.equal(converted[name], t), name
    original_tok, converted_tok = AutoTokenizer.from_pretrained(tiny), AutoTokenizer.from_pretrained(folder)
    encoded = [original_tok(prompt).input_ids for prompt in PROMPTS]
    for prompt, ids in zip(PROMPTS, encoded):
        assert converted_tok(prompt).input_ids == ids, prompt
        assert converted_tok.decode(ids) == original_tok.decode(ids) == prompt
    for got, want in zip(_logits(folder, encoded), _logits(tiny, encoded)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    # the tokenizer: special tokens, padding, the chat template, as the original's
    assert (converted_tok.bos_token, converted_tok.eos_token, converted_tok.pad_token) == ("<s>", "</s>", "<pad>")
    assert converted_tok.pad_token_id == original_tok.pad_token_id
    messages = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "c="}]
    rendered = original_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert converted_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    assert converted_tok(rendered).input_ids == original_tok(rendered).input_ids

    provenance = json.loads((Path(folder) / gguf.PROVENANCE).read_text())
    assert provenance == {"gguf_file": str(files["F32"].resolve()), "dtype": "float32",
                          "sha256": hashlib.sha256(files["F32"].read_bytes()).hexdigest()}


def test_a_q8_0_gguf_converts_into_its_dequantized_weights(tiny, files, cache):
    """Each 2-D weight is what gguf's own Q8_0 quantize-then-dequantize makes of the original (llama.cpp's row
    permutation of q and k commutes with quantizing rows); the norms stay exact; the logits stay close."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    folder = gguf.model_folder(str(files["Q8_0"]), "float32")
    converted = _weights(folder)
    for name, t in _weights(tiny).items():
        want = t if t.ndim == 1 else torch.from_numpy(dequantize(quantize(t.numpy(), GGMLQuantizationType.Q8_0),
                                                                 GGMLQuantizationType.Q8_0))
        assert torch.equal(converted[name], want), name
    ids = [[1, 33, 31, 17, 30, 80, 97, 15, 83, 98]]
    error = (_logits(folder, ids)[0] - _logits(tiny, ids)[0]).abs().max().item()
    assert 0 < error < 0.05, error


def test_the_folder_is_keyed_by_the_files_sha256_and_the_dtype(files, cache, tmp_path, monkeypatch):
    first = gguf.model_folder(str(files["F32"]), "float32")
    digest = hashlib.sha256(files["F32"].read_bytes()).hexdigest()
    assert Path(first).name == f"{digest[:16]}-float32"

    def convert(*args):
        raise AssertionError("converted again")

    with monkeypatch.context() as m:                     # a second call (and a copy of the file) finds the folder
        m.setattr(gguf, "_convert", convert)
        assert gguf.model_folder(str(files["F32"]), "float32") == first
        copy = tmp_path / "renamed.gguf"
        shutil.copyfile(files["F32"], copy)
        assert gguf.model_folder(str(copy), "float32") == first
    bf16 = gguf.model_folder(str(files["F32"]), "bfloat16")
    assert Path(bf16).name == f"{digest[:16]}-bfloat16" and bf16 != first
    assert {t.dtype for t in _weights(bf16).values()} == {torch.bfloat16}
    assert {t.dtype for t in _weights(first).values()} == {torch.float32}
    other = gguf.model_folder(str(files["Q8_0"]), "float32")      # other bytes: another folder
    assert other != first and Path(other).name.endswith("-float32")
    # the config's model.name_or_path routes through it (models.base_path), in model.dtype
    store = tmp_path / "store"
    cfg = load_config(TINY, [f"model.name_or_path={files['F32']}", "model.dtype=bfloat16", f"store.uri={store}"])
    from tasks.core.models import base_path

    assert base_path(cfg) == bf16
    assert sorted(p.name for p in (cache / "gguf").iterdir()) == sorted(     # (the hash memo: tasks/core/hashing.py)
        [Path(first).name, Path(bf16).name, Path(other).name])


def test_a_converted_file_is_not_read_again_but_other_bytes_are_checked(files, cache, tmp_path, monkeypatch):
    """Every stage resolves the policy's base (builtin:smollm2-135m: ~3 s to read its header, mostly the
    vocabulary): a file converted before is known by its identity and its header is not read again; a file of
    other bytes, or one changed since, is checked first and refused in one line."""
    from tasks.core import hashing
    from tasks.core.models import base_path

    monkeypatch.setattr(hashing, "REMEMBER_FROM", 0)      # (the tiny file's hash remembered, as SmolLM2's 93 MB)
    mine = tmp_path / "mine.gguf"
    shutil.copyfile(files["F32"], mine)
    cfg = load_config(TINY, [f"model.name_or_path={mine}", f"store.uri={tmp_path}/store"])
    first = base_path(cfg)
    read, check = [], gguf.check
    monkeypatch.setattr(gguf, "check", lambda path, field=gguf.FIELD: read.append(path) or check(path, field))
    assert base_path(cfg) == first and read == []
    mine.write_bytes(mine.read_bytes()[:-5000])            # changed since: read again, and refused
    with pytest.raises(UserError, match=f"^model.name_or_path: {mine}: cannot read this GGUF file"):
        base_path(cfg)
    assert read == [mine]


def _bad_files(tiny: str, folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (path, what its one line says after 'model.name_or_path: <path>: ')."""
    good = write_gguf(tiny, folder / "good.gguf")
    data = good.read_bytes()
    (folder / "text.gguf").write_text("this is a model, honest\n")
    (folder / "safetensors.gguf").write_bytes((Path(tiny) / "model.safetensors").read_bytes())
    (folder / "empty.gguf").write_bytes(b"")
    (folder / "magic-only.gguf").write_bytes(data[:8])
    (folder / "header-cut.gguf").write_bytes(data[:64])
    (folder / "tensors-cut.gguf").write_bytes(data[:-5000])
    (folder / "dir.gguf").mkdir()
    for arch in ("bert", "t5", "no-such-arch"):
        write_gguf(tiny, folder / f"{arch}.gguf", arch=arch)
    unreadable = "cannot read this GGUF file (damaged or cut short?): "
    return {
        "not GGUF (text)": (folder / "text.gguf", "not a GGUF file (its first bytes are not 'GGUF')"),
        "not GGUF (safetensors)": (folder / "safetensors.gguf", "not a GGUF file (its first bytes are not 'GGUF')"),
        "empty file": (folder / "empty.gguf", "not a GGUF file"),
        "truncated after the magic": (folder / "magic-only.gguf", unreadable),
        "truncated in the header": (folder / "header-cut.gguf", unreadable),
        "truncated in the tensors": (folder / "tensors-cut.gguf", unreadable),
        "encoder architecture": (folder / "bert.gguf", "GGUF architecture 'bert' is not one transformers can load"),
        "made-up architecture": (folder / "no-such-arch.gguf", "GGUF architecture 'no-such-arch' is not one "
                                 "transformers can load"),
        "not a causal LM": (folder / "t5.gguf", "architecture 't5' is not a causal language model transformers can "
                            "build from GGUF"),
        "no such file": (folder / "missing.gguf", "no such GGUF file"),
        "a folder": (folder / "dir.gguf", "a folder; expected a GGUF file"),
    }


def test_bad_gguf_files_are_one_line_each_and_leave_nothing_behind(tiny, tmp_path, cache):
    cases = _bad_files(tiny, tmp_path)
    failures = []
    for name, (path, expected) in cases.items():
        try:
            gguf.model_folder(str(path), "float32")
            failures.append(f"{name}: no error")
        except UserError as e:
            line = str(e)
            if "\n" in line or not line.startswith(f"model.name_or_path: {path}: {expected}") or len(line) > 400:
                failures.append(f"{name}: {line!r}")
    assert not failures, "\n".join(failures)
    assert not _leftovers(cache)                    # no half-converted folder, no temporary one
    # check() alone says the same before anything is read into memory
    with pytest.raises(UserError, match="is not a causal language model"):
        gguf.check(cases["not a causal LM"][0])
    assert gguf.check(tmp_path / "good.gguf") == "llama"


def test_a_missing_builtin_gguf_package_is_one_line(monkeypatch):
    monkeypatch.setitem(builtin_models.GGUF_BUILTINS, "smollm2-135m",
                        ("rlflow_no_such_package", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install no-such-package"))
    with pytest.raises(UserError) as e:
        builtin_models.resolve("builtin:smollm2-135m")
    assert str(e.value) == ("model.name_or_path: builtin:smollm2-135m needs the file SmolLM2-135M-Instruct.Q4_1.gguf "
                            "from the package rlflow_no_such_package (pip install no-such-package; make setup "
                            "installs it)")
    # a package that is there without the file: the same line
    monkeypatch.setitem(builtin_models.GGUF_BUILTINS, "smollm2-135m", ("json", "model.gguf", "pip install x"))
    with pytest.raises(UserError, match=r"^model.name_or_path: builtin:smollm2-135m needs the file model.gguf from "
                                        r"the package json \(pip install x; make setup installs it\)$"):
        builtin_models.resolve("builtin:smollm2-135m")
    with pytest.raises(UserError, match=r"unknown builtin model 'smollm3'; expected one of \[.*'smollm2-135m'.*\]"):
        builtin_models.resolve("builtin:smollm3")


@pytest.mark.slow
def test_a_run_starts_from_a_users_gguf_and_publishes_a_plain_model(files, tmp_path, prefect_api):
    """`rlflow run` with model.name_or_path a .gguf file: 2 iterations, the base model evaluated first
    (eval.baseline, greedy), and the published policy is an ordinary model folder of the same architecture."""
    out = run_cli(["run", str(TINY), "-o", f"model.name_or_path={files['F32']}", "-o", "run.name=from-gguf",
                   "-o", "run.iterations=2", "-o", "generate.prompts_per_iteration=4", "-o",
                   "generate.num_generations=4", "-o", "eval.every=2", "-o", "eval.baseline=true", "-o",
                   "eval.greedy=true", "-o", "eval.num_generations=2", "-o", "tracking.sample_completions=2",
                   "--summary-json", "s.json"], tmp_path, prefect_api)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = read_summary(tmp_path / "s.json")
    assert summary["iterations_completed"] == 2 and len(summary["reward_mean"]) == 2
    assert set(summary["held_out"]) == {"metric", "0", "2"}        # the base model (from the GGUF) and v2
    assert "train-set eval/reward_mean: base " in out.stdout        # (tiny's eval reads its training file)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.core import layout
    from tasks.core.store import Store

    store = Store.open(str(tmp_path / "rlflow-store"))
    assert summary["policy_uri"] == store.uri(layout.policy("from-gguf", 2))
    policy = tmp_path / "policy"
    store.get_folder(layout.policy("from-gguf", 2), policy)
    config = json.loads((policy / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(policy)
    tok = AutoTokenizer.from_pretrained(policy)
    start = gguf.model_folder(str(files["F32"]), "float32")        # (the folder the run converted: no work now)
    assert tok("c=ddd").input_ids == AutoTokenizer.from_pretrained(start)("c=ddd").input_ids
    trained, base = model.state_dict(), _weights(start)
    assert set(base) <= set(trained) and any(not torch.equal(trained[k], base[k]) for k in base)   # it trained


@pytest.fixture(scope="module")
def smollm2_folder(rlflow_cache) -> str:
    """The real builtin, converted once for this module (~60 s on 2 cores)."""
    path = builtin_models.resolve("builtin:smollm2-135m")
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and gguf.check(Path(path)) == "llama"
    return gguf.model_folder(path, "float32")


@pytest.mark.slow
def test_the_builtin_smollm2_converts_and_answers_arithmetic(smollm2_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((Path(smollm2_folder) / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama", 30, 576, 49152)
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 135_000_000
    assert tok.chat_template and tok.pad_token is not None
    assert tok.decode(tok("What is 7 + 5?").input_ids) == "What is 7 + 5?"
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "12" in answer, answer

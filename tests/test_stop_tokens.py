"""Stop tokens: a completion ends at any end-of-sequence id of the model (the tokenizer's EOS and each eos_token_id
of its generation_config.json: Qwen2.5-Instruct's <|im_end|> and <|endoftext|>), as TRL's generate and vLLM stop,
in every engine, the judge and the episode loop; ended there (the stop token kept), it is not truncated. A tiny
model with a ChatML tokenizer, built to write "a" and then <|endoftext|>, never the tokenizer's EOS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tasks.core import builtin_models
from tasks.core.config import load_config
from tasks.core.contracts import Sample, Sampled, SamplingParams
from tasks.core.models import load_model, load_tokenizer
from tasks.engines.hf import HFEngine, hf_generate, sampler_model
from tasks.engines.hf_stream import ContinuousSampler, _Finished
from tasks.engines.streaming import Row

ROOT = Path(__file__).resolve().parents[1]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MAX_NEW = 8


def _tokenizer():
    tok = builtin_models.build_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]})
    tok.chat_template, tok.eos_token = CHATML, "<|im_end|>"
    return tok


@pytest.fixture(scope="module")
def qwenish(tmp_path_factory) -> Path:
    """The model's next token is a function of its last one (attention and MLPs write nothing, the embedding
    is the hidden state): "a" after any token but "a", <|endoftext|> after "a". Its generation_config stops on
    [<|im_end|>, <|endoftext|>], Qwen2.5-Instruct's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    a, eot, eos = (tok.convert_tokens_to_ids(t) for t in ("a", "<|endoftext|>", "<|im_end|>"))
    config = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, tie_word_embeddings=False, **builtin_models.BUILTINS["tiny-lm"])
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0
        emb[a] = 0.0
        emb[a, 1] = 1.0
        head.zero_()
        head[a, 0] = head[eot, 1] = 20.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.generation_config.eos_token_id = [eos, eot]
    model.generation_config.pad_token_id = tok.pad_token_id
    path = tmp_path_factory.mktemp("qwenish")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _ids(path: Path) -> tuple[int, int, int]:
    tok = load_tokenizer(str(path))
    return tuple(tok.convert_tokens_to_ids(t) for t in ("a", "<|endoftext|>", "<|im_end|>"))


def _prompt(tok) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": "Say a"}], add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------ the stop ids

def _with_generation_config(src: Path, dest: Path, eos) -> Path:
    """A copy of the model's tokenizer files, with a generation_config.json of `eos` (None: none)."""
    dest.mkdir()
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")) or f.name == "config.json":
            shutil.copy(f, dest / f.name)
    if eos is not None:
        (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return dest


def test_the_stop_ids_are_the_eos_then_each_of_the_generation_config(qwenish, tmp_path):
    from tasks.core.models import stop_token_ids

    a, eot, eos = _ids(qwenish)
    assert stop_token_ids(load_tokenizer(str(qwenish))) == [eos, eot]
    cases = {"list": ([eot, eos], [eos, eot]), "int": (eot, [eos, eot]), "same": (eos, [eos]), "none": (None, [eos]),
             "three": ([eos, eot, a, eot], [eos, eot, a])}
    for name, (given, want) in cases.items():
        folder = _with_generation_config(qwenish, tmp_path / name, given)
        assert stop_token_ids(load_tokenizer(str(folder))) == want, name       # (same tokenizer bytes: not shared)
        assert stop_token_ids(_tokenizer(), str(folder)) == want, name
    bare = _tokenizer()           # (not from a folder: its EOS alone)
    assert stop_token_ids(bare) == [eos]


# ------------------------------------------------------------------------------------------ the hf engine

def test_the_hf_engine_stops_at_any_stop_id_and_the_completion_is_not_truncated(qwenish):
    a, eot, _ = _ids(qwenish)
    tok = load_tokenizer(str(qwenish))
    model = sampler_model(load_model(str(qwenish)))
    params = SamplingParams(n=2, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=0)
    for share in (True, False):
        samples = hf_generate(model, tok, [_prompt(tok), _prompt(tok)[1:]], params, batch_size=4, share_prompts=share)
        assert [s.completion_ids for s in samples] == [[a, eot]] * 4
        assert [s.truncated for s in samples] == [False] * 4
        assert all(len(s.logprobs) == 2 for s in samples)


def test_the_streaming_sampler_stops_at_any_stop_id(qwenish):
    a, eot, _ = _ids(qwenish)
    tok = load_tokenizer(str(qwenish))
    model = sampler_model(load_model(str(qwenish)))
    sampler = ContinuousSampler(tok, SamplingParams(n=2, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=0),
                                MAX_NEW)
    rows = [Row(0, _prompt(tok)), Row(0, _prompt(tok))]
    assert not sampler.step_batch(model, rows, 0, lambda finished, n: False)
    assert [(r.tokens, r.done, r.truncated) for r in rows] == [([a, eot], True, False)] * 2
    watch = _Finished(1, [tok.eos_token_id, eot], None)        # (what `stop` is told: rows that drew a stop id)
    watch(torch.tensor([[5, a, eot, 0], [5, a, a, a], [5, a, tok.eos_token_id, 0]]), None)
    assert watch.finished == 2


def test_the_judge_answer_ends_at_any_stop_id(qwenish):
    from tasks.scoring.judge_engine import JudgeEngine

    judge = JudgeEngine(str(qwenish), "judge", device="cpu")
    [answer] = judge.chat([{"messages": [{"role": "user", "content": "Say a"}], "max_tokens": MAX_NEW}])
    assert (answer["text"], answer["tokens"]) == ("a", 1)


# ------------------------------------------------------------------------------------------ episodes

def test_an_episode_turn_ends_at_any_stop_id_and_its_closing_is_written_in_full(qwenish, tmp_path):
    """Each model turn is "a" and <|endoftext|>; the template's closing after it keeps its <|im_end|> (the turn
    did not write it), so the episode is the turn's tokens then the template's rendering of what follows."""
    from tasks.envs.runtime.episodes import run_episodes

    a, eot, eos = _ids(qwenish)
    tok = load_tokenizer(str(qwenish))
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "Say each letter I name.", "letters": "abc", "seed": 0}) + "\n")
    cfg = load_config(ROOT / "configs" / "letters.yaml", [
        f"data.path={data}", "env.factory=tasks.envs.builtin.games:SayTheLetters", "env.max_tokens=400",
        f"generate.max_completion_length={MAX_NEW}", f"model.name_or_path={qwenish}", "train.device=cpu"])
    engine = HFEngine(cfg)
    try:
        records, _ = run_episodes(cfg, {0: {"prompt": "Say each letter I name.", "letters": "abc", "seed": 0}}, [0],
                                  engine.session("base", str(qwenish), tok),
                                  SamplingParams(n=1, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=3))
    finally:
        engine.stop()
    [r] = records
    assert r.env_error is None and not r.truncated
    turns = [t for t, m in zip(r.completion_ids, r.mask) if m]
    assert turns == [a, eot] * 3
    text = tok.decode(r.completion_ids)
    assert text.startswith("a<|endoftext|><|im_end|>\n<|im_start|>user\nyes. Say b<|im_end|>\n<|im_start|>assistant\n")
    assert r.env_return == pytest.approx(1 / 3)       # ("a" is right once: for the letter a)


# ------------------------------------------------------------------------------------------ vLLM's requests

def test_the_vllm_requests_stop_on_each_stop_id(qwenish, monkeypatch):
    from tasks.engines import vllm_server
    from tasks.engines.vllm_offline import OfflineSession
    from tasks.engines.vllm_stream import VLLMDecoder

    _, eot, eos = _ids(qwenish)
    tok = load_tokenizer(str(qwenish))
    params = SamplingParams(n=1, max_new_tokens=MAX_NEW, temperature=1.0, top_p=1.0, seed=0)
    asked = []

    offline = object.__new__(OfflineSession)        # (no worker: its request is what is checked)
    offline.tokenizer, offline.lora = tok, None
    offline.ask = lambda request: asked.append(request) or {"samples": [], "sampling_seconds": 0.0,
                                                            "rows": [["0", [eot], [-0.1], True, False]], "running": 0}
    offline.sample([[1, 2]], params)
    assert asked[-1]["sampling"]["stop_token_ids"] == [eos, eot]

    cfg = load_config(ROOT / "configs" / "letters.yaml", [])
    decoder = VLLMDecoder(cfg, params)
    decoder.session = offline
    decoder.step_batch([Row(0, [1, 2])], 0, lambda finished, n: False)
    assert asked[-1]["stream"]["sampling"]["stop_token_ids"] == [eos, eot]

    class Server:
        path = Path(cfg.run.name)

        def load(self, *args):
            pass

        def verify(self):
            pass

        def complete(self, prompt_ids, seeds, params, stop_token_ids):
            asked.append(stop_token_ids)
            return [Sample(0, [eot], [-0.1], False)]

    monkeypatch.setattr(vllm_server.Server, "ensure", staticmethod(lambda *a: Server()))
    monkeypatch.setattr(vllm_server.os, "utime", lambda *a: None)
    served = object.__new__(vllm_server.ServerSession)
    served.cfg, served.policy, served.path, served.tokenizer = cfg, "base", str(qwenish), tok
    served.model, served.adapter = str(qwenish), False
    assert isinstance(served.sample([[1, 2]], params), Sampled) and asked[-1] == [eos, eot]


def test_a_lora_policys_folder_and_a_model_without_generation_config_keep_the_models_stop_ids(qwenish, tmp_path):
    """A LoRA policy's folder holds the adapter and the tokenizer, no generation_config.json (peft writes none):
    its stop ids were the tokenizer's EOS alone from the first adapter on, where TRL's generate keeps the base
    model's. They are the base model's now (adapter_config.json names it); and a model with a config.json alone
    has transformers' generation config made from it: its eos_token_id."""
    from tasks.core.models import ADAPTER_CONFIG, stop_token_ids

    a, eot, eos = _ids(qwenish)
    adapter = _with_generation_config(qwenish, tmp_path / "lora", None)
    (adapter / "config.json").unlink()
    (adapter / ADAPTER_CONFIG).write_text(json.dumps({"base_model_name_or_path": str(qwenish), "peft_type": "LORA"}))
    assert stop_token_ids(load_tokenizer(str(adapter))) == [eos, eot]
    plain = _with_generation_config(qwenish, tmp_path / "plain", None)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "eos_token_id": [eos, eot]}))
    assert stop_token_ids(load_tokenizer(str(plain))) == [eos, eot]
    shared = load_tokenizer(str(qwenish))
    assert stop_token_ids(shared, str(plain / "nowhere")) == [eos] and stop_token_ids(shared) == [eos, eot]

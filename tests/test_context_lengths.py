"""Lengths a run cannot afford, refused (or warned of) before it starts: a reasoning-gym split too large to make
in memory, and prompt + completion lengths past the model's context (vLLM's derived max_model_len)."""

import pytest

from tasks.core.config import load_config
from tasks.core.errors import UserError
from tests.conftest import TINY


@pytest.mark.parametrize("field", ["size", "eval_size"])
def test_a_reasoning_gym_split_a_run_cannot_make_is_refused_as_the_config_is_read(field):
    """A million held-out items took `rlflow plan` 4 minutes and 5 GB: the bound is 100,000 items."""
    sizes = {"size": 10, "eval_size": 10, field: 1000000}
    spec = "{task: leg_counting, " + ", ".join(f"{k}: {v}" for k, v in sizes.items()) + "}"
    with pytest.raises(UserError, match=rf"data\.reasoning_gym\.{field}: input should be less than or equal to "
                                        r"100000, got 1000000"):
        load_config(TINY, ["data.path=null", f"data.reasoning_gym={spec}"])
    load_config(TINY, ["data.path=null", "data.reasoning_gym={task: leg_counting, size: 100000, eval_size: 100000}"])


def _model(folder, **config):
    """A model folder with config.json alone (and tokenizer_config.json when `tokenizer` is given): what
    engine_context reads."""
    import json

    tokenizer = config.pop("tokenizer", None)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    return str(folder)


def test_the_context_is_the_one_vllm_derives(tmp_path):
    """The config's smallest length key, within the tokenizer's model_max_length, times a RoPE factor that the
    config's length does not hold already (vllm/config/model.py: _get_and_verify_max_len)."""
    from tasks.core.builtin_models import resolve
    from tasks.core.models import engine_context

    assert engine_context(resolve("builtin:tiny-lm")) == (256, "its config's max_position_embeddings", True)
    llama = dict(model_type="llama", max_position_embeddings=4096)
    assert engine_context(_model(tmp_path / "a", **llama, tokenizer={"model_max_length": 2048})) == \
        (2048, "its tokenizer's model_max_length", True)
    assert engine_context(_model(tmp_path / "b", **llama, rope_scaling={"rope_type": "linear", "factor": 2.0}))[0] \
        == 8192
    assert engine_context(_model(tmp_path / "c", **llama, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                        "original_max_position_embeddings": 1024}))[0] \
        == 4096
    assert engine_context(_model(tmp_path / "d", model_type="gpt2", n_positions=1024)) == \
        (1024, "its config's max_position_embeddings", False)      # (transformers maps n_positions to it)


def _cfg(*overrides):
    return load_config(TINY, ["generate.max_prompt_length=512", "generate.max_completion_length=4", *overrides])


@pytest.mark.parametrize(("overrides", "line"), [
    # vLLM's traceback after ~4 minutes, the store written: "User-specified max_model_len (100000) is greater than
    # the derived max_model_len (max_position_embeddings=256 ..."
    (["generate.max_model_len=100000"],
     "generate.max_model_len: 100000 is above the model's context (256, its config's max_position_embeddings), "
     "which vLLM refuses to start with; expected at most 256, or null (max_prompt_length + the completion's limit, "
     "capped there)"),
])
def test_vllm_lengths_past_the_models_context_are_one_line(overrides, line):
    from flows.preflight import check_context
    from tasks.core.builtin_models import resolve

    with pytest.raises(UserError) as e:
        check_context(_cfg("generate.engine=vllm", *overrides), resolve("builtin:tiny-lm"))
    assert str(e.value) == line


def test_vllm_lengths_within_the_context_pass_and_are_the_engines_max_model_len():
    from flows.preflight import check_context
    from tasks.core.builtin_models import resolve
    from tasks.engines.vllm_offline import max_model_len

    path = resolve("builtin:tiny-lm")
    for overrides, engine_len in ((["generate.max_prompt_length=252"], 256), (["generate.max_prompt_length=100"], 104),
                                  (["generate.max_prompt_length=100", "generate.max_model_len=256"], 256)):
        cfg = _cfg("generate.engine=vllm", *overrides)
        check_context(cfg, path)
        assert max_model_len(cfg, path) == engine_len


def test_vllm_completions_past_the_context_are_a_warning(capsys, monkeypatch):
    """A prompt below the context with a completion limit past it: vLLM stops the completion at the context (only
    a prompt as long as max_model_len fails), so a warning, not a refusal."""
    from flows.preflight import check_context
    from tasks.core import config_base
    from tasks.core.builtin_models import resolve

    monkeypatch.setattr(config_base, "_SAID", set())
    capsys.readouterr()
    check_context(_cfg("generate.engine=vllm", "generate.max_prompt_length=250", "generate.max_completion_length=300"),
                  resolve("builtin:tiny-lm"))
    assert capsys.readouterr().err.startswith(
        "warning: generate.max_prompt_length: 250 + max_completion_length 300 = 550 tokens is above the model's "
        "context (256, its config's max_position_embeddings): on the vllm engine a sequence that long is stopped at "
        "the context (vLLM's max_model_len), and a prompt as long as that fails the run; expected at most 256 "
        "together")


def test_hf_lengths_past_the_context_are_said_only_for_learned_positions(tmp_path, capsys, monkeypatch):
    """The hf engine runs a rotary model past its context (degraded, as transformers allows): nothing said; a
    model with learned positions fails there: a warning, and the run goes on."""
    from flows.preflight import check_context
    from tasks.core import config_base
    from tasks.core.builtin_models import resolve

    monkeypatch.setattr(config_base, "_SAID", set())
    capsys.readouterr()
    check_context(_cfg(), resolve("builtin:tiny-lm"))                  # 512 + 4 on a rotary 256
    assert capsys.readouterr().err == ""
    check_context(_cfg(), _model(tmp_path / "gpt2", model_type="gpt2", n_positions=256))
    assert capsys.readouterr().err == (
        "warning: generate.max_prompt_length: 512 + max_completion_length 4 = 516 tokens is above the model's context "
        "(256, its config's max_position_embeddings): on the hf engine a sequence that long fails (its learned "
        "positions end there); expected at most 256 together (max_prompt_length 252 or less)\n")


@pytest.mark.vllm
@pytest.mark.parametrize("case", ["max_model_len"])
def test_plan_refuses_vllm_lengths_past_the_context_and_writes_nothing(tmp_path, case):
    """The sweep's two: `rlflow run` went on for minutes and wrote the store before vLLM refused; plan said 0."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, VLLM_PYTHON

    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "a" * 1001, "answer": "bbb"}) + "\n")
    more = {"max_model_len": "generate.max_model_len=100000", "long prompt": f"data.path={tmp_path / 'long.jsonl'}"}
    args = [str(TINY), "-o", "generate.engine=vllm", "-o", f"generate.vllm_python={VLLM_PYTHON}", "-o", more[case],
            "-o", "generate.max_prompt_length=512",
            "-o", f"store.uri={tmp_path / 'store'}"]
    out = subprocess.run([sys.executable, "-m", "flows.cli", "plan", *args], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})   # (this checkout's)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    field = "generate.max_model_len: 100000" if case == "max_model_len" else "generate.max_prompt_length: 512"
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {field} "), out.stderr[-2000:]
    assert "the model's context (256, its config's max_position_embeddings)" in lines[0]
    assert not (tmp_path / "store").exists()


def test_an_episodes_lengths_are_its_first_prompt_and_env_max_tokens(capsys, monkeypatch):
    """Episodes: the tokens after the first prompt are env.max_tokens (every turn and observation), not
    max_completion_length (one turn's): that sum is what must fit the context."""
    from flows.preflight import check_context
    from tasks.core import config_base
    from tasks.core.builtin_models import resolve

    monkeypatch.setattr(config_base, "_SAID", set())
    path, letters = resolve("builtin:tiny-lm"), TINY.parent / "letters.yaml"
    from tasks.engines.vllm_offline import max_model_len

    within = load_config(letters, ["generate.engine=vllm", "generate.max_prompt_length=128"])
    check_context(within, path)                                           # 128 + 96: within 256
    assert capsys.readouterr().err == "" and max_model_len(within, path) == 224    # (not 128 + 1: a turn's)
    check_context(load_config(letters, ["generate.engine=vllm", "generate.max_prompt_length=200"]), path)
    assert capsys.readouterr().err.startswith("warning: generate.max_prompt_length: 200 + env.max_tokens 96 = 296 "
                                              "tokens is above the model's context (256")


def test_an_episode_that_vllms_max_model_len_cannot_hold_is_said_as_the_config_is_read(capsys):
    """A max_model_len set by hand was checked against max_prompt_length + max_completion_length alone: an
    episode's later turns (env.max_tokens after its first prompt) passed it and were cut or failed, unsaid. A
    warning, as where the model's context caps the default (a stored run's config still loads)."""
    episodes = ["env.factory=tasks.envs.builtin.games:SayTheLetters", "env.max_tokens=200", "generate.engine=vllm"]
    _cfg(*episodes, "generate.max_model_len=600")
    assert "warning: generate.max_model_len: 600 is less than an episode can take: its first prompt " \
           "(max_prompt_length 512) and env.max_tokens (200) after it, 712" in capsys.readouterr().err
    _cfg(*episodes, "generate.max_model_len=712")
    _cfg(*episodes[:2], "generate.max_model_len=601")        # (hf: not read)
    assert "is less than an episode can take" not in capsys.readouterr().err


def test_plan_shows_the_models_context_beside_what_a_sequence_may_take(tmp_path):
    """The prompt-cut warning sends a user to `rlflow plan` for the context, which plan never printed."""
    from flows.plan import plan

    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "generate.max_prompt_length=512"])
    assert "  model:     builtin:tiny-lm (context 256 tokens, its config's max_position_embeddings; a sequence up " \
           "to 512 + 4 = 516: generate.max_prompt_length + max_completion_length, past the context)\n" \
        in plan(cfg, str(TINY))
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "generate.max_prompt_length=100"])
    assert "; a sequence up to 100 + 4 = 104: generate.max_prompt_length + max_completion_length)\n" \
        in plan(cfg, str(TINY))

"""The check before a run drives the environment as far as its first turn: what step returns, what reset returns,
what the factory made, each refused in one line before anything is written (the rule of tests/test_bad_input.py);
and two config mistakes said for what they are (an override by list index, publish.delta beside LoRA)."""

from __future__ import annotations

import pytest

from tasks.core.errors import UserError
from tests.conftest import ROOT, TINY, run_cli, user_module

LETTERS = ROOT / "configs" / "letters.yaml"
ROW = {"prompt": "Say each letter I name.", "letters": "abc"}

ENVS = '''
from tasks.core.contracts import Step
from tasks.envs.builtin.games import SayTheLetters


class StepRewardNone(SayTheLetters):
    def step(self, message):
        s = super().step(message)
        return ([{"role": "user", "content": "next"}], None, s.done, {})


class StepDoneText(SayTheLetters):
    def step(self, message):
        s = super().step(message)
        return (s.observation, s.reward, "no", {})


class StepDoneFloat(SayTheLetters):      # (done = float(terminated): a masking habit of RL code)
    def step(self, message):
        s = super().step(message)
        return (s.observation, s.reward, float(s.done), {})


class StepNoneObs(SayTheLetters):
    def step(self, message):
        super().step(message)
        return (None, 0.0, False, {})


class StepReturnsStr(SayTheLetters):
    def step(self, message):
        return "yes"


class StepRewardNan(SayTheLetters):
    def step(self, message):
        return Step([], float("nan"), True)


class AsyncStepRewardNone(SayTheLetters):
    async def step(self, message):
        return ([], None, True)


class AsyncLetters(SayTheLetters):
    async def reset(self, row):
        return super().reset(row)

    async def step(self, message):
        return super().step(message)


class StepRaises(SayTheLetters):
    def step(self, message):
        raise ValueError("cannot parse the move")         # the environment's own failure: the episodes' to report


class StepAsTuple(SayTheLetters):
    def step(self, message):
        import numpy as np
        return ("yes", np.float32(0.5), True)


class ResetEmpty(SayTheLetters):
    def reset(self, row):
        super().reset(row)
        return []


class ToolsOnly:
    def say(self, letter: str) -> str:
        """Say a letter.

        Args:
            letter: the letter
        """
        return "ok"


def returns_dict(**kw):
    return {"reset": 1}


def returns_42(**kw):
    return 42
'''


@pytest.fixture
def envs(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "pf_envs", ENVS)


def _check(factory: str, *more: str) -> None:
    from tasks.core.config import load_config
    from tasks.envs.runtime.protocol import check_environment

    check_environment(load_config(LETTERS, [f"env.factory=pf_envs:{factory}", *more]), dict(ROW))


@pytest.mark.parametrize("factory, said", [
    ("StepRewardNone", "step returned reward None, not a finite number"),
    ("StepNoneObs", "step's observation is NoneType, not chat messages"),
    ("StepReturnsStr", "step returned str, not a Step or (observation, reward, done[, info])"),
    ("StepRewardNan", "step returned reward nan, not a finite number"),
    ("AsyncStepRewardNone", "step returned reward None, not a finite number"),
    ("StepDoneText", "step returned done 'no', not a bool"),        # (read as true: every episode one turn long)
])
def test_a_step_that_returns_what_no_episode_takes_is_one_line_before_the_run(envs, factory, said):
    """Every episode failed with this after the run had started (mlflow.db, the store and a lock written)."""
    with pytest.raises(UserError) as e:
        _check(factory)
    line = str(e.value)
    assert line.startswith(f"env.factory: pf_envs:{factory}: {factory}.step(message) on the first turn: {said}")
    assert "; expected a Step or (observation: chat messages, reward: a finite number, done[, info])" in line
    assert "\n" not in line


def test_environments_whose_first_step_is_fine_or_their_own_to_fail_still_pass(envs):
    """An async environment (reset and step awaited: the check refused its reset's coroutine as 'not chat
    messages'), a gymnasium-style tuple with a numpy reward, a step that raises (the episodes report that), a TRL
    environment_factory class (no step: tools) and rlflow's own game all pass."""
    from tasks.core.config import load_config
    from tasks.envs.runtime.protocol import check_environment

    _check("AsyncLetters")
    _check("StepAsTuple")
    _check("StepRaises")
    _check("StepDoneFloat")
    check_environment(load_config(LETTERS, ["env.factory=tests.env_classes:Counter"]), dict(ROW))
    check_environment(load_config(LETTERS, []), dict(ROW))


def test_a_reset_that_returns_no_messages_is_one_line_before_the_run(envs):
    """Every episode failed with 'Cannot apply chat template to an empty conversation'."""
    with pytest.raises(UserError, match=r"^env.factory: pf_envs:ResetEmpty: ResetEmpty.reset on the data's first "
                                        r"row returned no messages; expected at least one chat message"):
        _check("ResetEmpty")


@pytest.mark.parametrize("factory, made", [("ToolsOnly", "a ToolsOnly"), ("returns_dict", "a dict {'reset': 1}"),
                                           ("returns_42", "an int 42")])
def test_a_factory_that_makes_something_without_reset_says_so(envs, factory, made):
    """Was: 'whose reset(row) is rlflow's protocol's but it has no step(message) method' (it has no reset). TRL's
    environment_factory needs a reset too (GRPOTrainer refuses a class without one)."""
    with pytest.raises(UserError) as e:
        _check(factory)
    assert str(e.value) == (f"env.factory: pf_envs:{factory} made {made}, which has no reset method; expected an "
                            f"environment: an object with reset(row) and step(message) (rlflow's protocol), or one "
                            f"with reset(**row) and tools as methods (TRL's environment_factory classes)")


def test_run_with_a_step_that_returns_reward_none_exits_2_and_writes_nothing(prefect_api, tmp_path):
    """End to end: one line, exit 2, no store, no tracking database (was: exit 2 after the first iteration's
    episodes had all failed, a FAILED run in mlflow.db and the run's folder in the store)."""
    (tmp_path / "pf_envs.py").write_text(ENVS)
    out = run_cli(["run", str(LETTERS), "-o", "run.iterations=1", "-o", "env.factory=pf_envs:StepRewardNone"],
                  tmp_path, prefect_api)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert not (tmp_path / "rlflow-store").exists() and not (tmp_path / "mlflow.db").exists(), lines
    assert lines[0].startswith("error: env.factory: pf_envs:StepRewardNone: StepRewardNone.step(message) on the "
                               "first turn: step returned reward None, not a finite number"), lines


def test_an_override_by_list_index_says_a_list_is_set_whole():
    from tasks.core.config import load_config

    with pytest.raises(UserError) as e:
        load_config(TINY, ["reward.functions.0.weight=2"])
    assert str(e.value) == ("override 'reward.functions.0.weight=2': a list item cannot be set by index; set the "
                            "whole list, e.g. -o 'reward.functions=[{..., weight: 2}]'")
    with pytest.raises(UserError, match=r"set the whole list, e.g. -o 'train.lora_target_modules=\[\.\.\., q_proj\]'"):
        load_config(TINY, ["train.lora_target_modules.1=q_proj"])
    with pytest.raises(UserError, match=r"^override 'train.1lr=3': expected a dotted key such as train.lr$"):
        load_config(TINY, ["train.1lr=3"])


def test_publish_delta_beside_lora_is_warned_of(capsys):
    """LoRA adapters are always published whole: publish.delta set with train.lora_r did nothing, silently."""
    from tasks.core import config_base
    from tasks.core.config import load_config

    cfg = load_config(TINY, ["publish.delta=always", "train.lora_r=4"])
    assert 'warning: config: publish.delta is set to "always" but has no effect: LoRA adapters are published ' \
           'whole' in capsys.readouterr().err
    config_base._SAID.clear()
    type(cfg).model_validate(cfg.model_dump())                 # (a stage process given the config: not again)
    load_config(TINY, ["publish.delta=always"])                # (read: no LoRA)
    load_config(TINY, ["publish.delta=auto", "train.lora_r=4"])    # (the default)
    assert capsys.readouterr().err == ""


def test_an_override_by_list_index_shows_the_item_in_its_place_and_quotes_for_the_shell():
    """`reward.functions.1.weight=2` suggested a one-item list (`[{..., weight: 2}]`: the first function gone);
    a value with a ' broke the example's single quotes."""
    import subprocess

    from tasks.core.config import load_config

    def example(override: str) -> str:
        with pytest.raises(UserError) as e:
            load_config(TINY, [override])
        said = str(e.value)
        assert "a list item cannot be set by index; set the whole list, e.g. -o " in said, said
        return said.split("e.g. -o ", 1)[1]

    assert example("reward.functions.1.weight=2") == "'reward.functions=[..., {..., weight: 2}]'"
    assert example("reward.functions.0.weight=2") == "'reward.functions=[{..., weight: 2}]'"
    assert example("train.lora_target_modules.0=q_proj") == "'train.lora_target_modules=[q_proj]'"
    assert example("train.lora_target_modules.3=q_proj") == "'train.lora_target_modules=[..., q_proj]'"
    for raw in ("it's", "it's \"$HOME\" `x` \\n"):
        said = example(f"reward.functions.1.name={raw}")
        word = subprocess.run(["bash", "-c", f"printf %s {said}"], capture_output=True, text=True).stdout
        assert word == f"reward.functions=[..., {{..., name: {raw}}}]", said       # (one word, as it was given)


EMPTY_RESETS = '''
import asyncio

from tasks.envs.builtin.games import SayTheLetters


class ResetEmpty(SayTheLetters):
    def reset(self, row):
        super().reset(row)
        return []


class LeavesATask(SayTheLetters):
    async def reset(self, row):
        asyncio.get_running_loop().create_task(asyncio.sleep(3600))      # (never awaited: pending at the close)
        return super().reset(row)

    async def step(self, message):
        return super().step(message)
'''


class _Renders:
    """A tokenizer whose chat template renders a prompt from no messages (Qwen's: a default system prompt)."""

    def __init__(self, text: str):
        self.text = text

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=False, tokenize=True):
        return self.text


@pytest.fixture
def empty_resets(tmp_path, monkeypatch):
    user_module(tmp_path, monkeypatch, "pf_empty", EMPTY_RESETS)


def _check_empty(factory: str) -> None:
    from tasks.core.config import load_config
    from tasks.envs.runtime.protocol import check_environment

    check_environment(load_config(LETTERS, [f"env.factory=pf_empty:{factory}"]), dict(ROW))


def test_a_reset_of_no_messages_is_refused_only_where_the_template_renders_no_prompt(empty_resets, monkeypatch,
                                                                                      capsys):
    """A reset returning [] was refused whatever the policy: a chat template that renders a prompt from none ran
    such environments. The tiny model's (transformers refuses an empty conversation) is still one line, naming
    why; a template rendering nothing is too; where the tokenizer cannot be had, a warning."""
    from tasks.core import models

    with pytest.raises(UserError) as e:
        _check_empty("ResetEmpty")
    assert str(e.value).startswith("env.factory: pf_empty:ResetEmpty: ResetEmpty.reset on the data's first row "
                                   "returned no messages; expected at least one chat message"), str(e.value)
    assert "empty conversation" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(models, "base_path", lambda cfg: "unused")
    monkeypatch.setattr(models, "load_tokenizer", lambda path: _Renders("<|im_start|>system\nYou are Qwen.<|im_end|>"
                                                                        "\n<|im_start|>assistant\n"))
    _check_empty("ResetEmpty")                                                  # (renders a prompt: passes)
    monkeypatch.setattr(models, "load_tokenizer", lambda path: _Renders(""))
    with pytest.raises(UserError, match=r"returned no messages; expected at least one chat message .*renders ''"):
        _check_empty("ResetEmpty")
    capsys.readouterr()

    def cannot(path):
        raise UserError("model.name_or_path: cannot load tokenizer from 'unused'")
    monkeypatch.setattr(models, "load_tokenizer", cannot)
    _check_empty("ResetEmpty")
    err = capsys.readouterr().err
    assert err.startswith("warning: env.factory: pf_empty:ResetEmpty: ResetEmpty.reset on the data's first row "
                          "returned no messages; ") and err.count("\n") == 1, err


def test_what_an_async_reset_leaves_running_is_cancelled_before_its_loop_closes(empty_resets, caplog):
    """The check's event loop was closed with the task still pending: 'Task was destroyed but it is pending!'
    (asyncio's error log) once it was collected."""
    import gc
    import logging

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        _check_empty("LeavesATask")
        gc.collect()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()], caplog.text


@pytest.mark.parametrize("item", ["=5", "=", "=1e3"])
def test_an_override_without_a_key_is_one_line(item):
    """`-o =5`: an UnboundLocalError traceback and exit 1 (the check's short cut skipped naming its parts)."""
    from tasks.core.config import load_config

    with pytest.raises(UserError, match=rf"^override '{item}': expected a dotted key such as train.lr$"):
        load_config(TINY, [item])

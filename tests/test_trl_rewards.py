"""Reward functions written the way TRL's documentation writes them run unchanged, and score what TRL's own
GRPOTrainer._calculate_rewards gives for the same inputs: every argument by keyword, chat completions as
[{"role": "assistant", "content": ...}] lists, trainer_state, log_extra, log_metric, async functions. Their
signatures are checked against the dataset's columns before anything runs."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest
import torch

from tasks.core.config import load_config
from tasks.core.contracts import Rollout
from tasks.core.errors import UserError
from tasks.scoring.functions import load_functions, score_records, trl_inputs
from tasks.scoring.worker import RewardState
from tests.conftest import TINY

# From TRL's docs (GRPOTrainer: "Using a custom reward function", quickstart), as users copy them.
TRL_DOCS = textwrap.dedent(r'''
    import re
    import asyncio

    def reward_len(completions, **kwargs):
        return [-abs(20 - len(completion)) for completion in completions]

    def reward_func(completion_ids, **kwargs):
        """Reward function that assigns higher scores to longer completions (in terms of token count)."""
        return [float(len(ids)) for ids in completion_ids]

    def prompt_and_completion(prompts, completions, **kwargs):
        return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]

    def format_reward_func(completions, **kwargs):
        """Reward function that checks if the completion has a specific format."""
        pattern = r"^<think>.*?</think><answer>.*?</answer>$"
        completion_contents = [completion[0]["content"] for completion in completions]
        matches = [re.match(pattern, content) for content in completion_contents]
        return [1.0 if match else 0.0 for match in matches]

    def ground_truth_reward(completions, ground_truth, **kwargs):
        # Regular expression to capture content inside \boxed{}
        matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
        contents = [match.group(1) if match else "" for match in matches]
        # Reward 1 if the content is the same as the ground truth, 0 otherwise
        return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]

    def chat_ground_truth(completions, ground_truth, **kwargs):
        contents = [completion[0]["content"] for completion in completions]
        return [1.0 if gt in c else 0.0 for c, gt in zip(contents, ground_truth)]

    def scheduled(completions, trainer_state, **kwargs):
        return [float(trainer_state.global_step)] * len(completions)

    def logs(completions, log_extra=None, log_metric=None, **kwargs):
        log_extra("length", [len(str(c)) for c in completions])
        log_metric("calls", 1.0)
        return [0.5] * len(completions)

    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0 if "answer" in str(c) else 0.0 for c in completions]

    def no_kwargs(completions, ground_truth):
        return [float(len(gt)) for gt in ground_truth]

    def needs_missing(completions, solution, **kwargs):
        return [0.0] * len(completions)

    def positional_only(completions, /, **kwargs):
        return [0.0] * len(completions)
''')

TEXT_FUNCS = ["reward_len", "reward_func", "prompt_and_completion", "ground_truth_reward", "scheduled", "logs",
              "async_reward", "no_kwargs"]
CHAT_FUNCS = ["reward_func", "format_reward_func", "chat_ground_truth", "scheduled", "logs", "async_reward",
              "no_kwargs"]
COMPLETIONS = ["<think>x</think><answer>\\boxed{4}</answer>", "it is \\boxed{5}", "4", "<think></think><answer>4"]


@pytest.fixture
def docs_module(tmp_path, monkeypatch):
    (tmp_path / "trl_docs_rewards.py").write_text(TRL_DOCS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("trl_docs_rewards")


def _records(chat: bool) -> list[Rollout]:
    prompt = [{"role": "user", "content": "2+2?"}] if chat else "2+2?"
    return [Rollout(group=j // 2, row=j, prompt=prompt, prompt_ids=[1, 2], completion=c,
                    completion_ids=list(range(j + 1)), logprobs=[0.0] * (j + 1), truncated=False,
                    columns={"ground_truth": "4"})
            for j, c in enumerate(COMPLETIONS)]


def _functions(names: list[str], columns=None):
    cfg = load_config(TINY, [f"reward.functions={json.dumps([{'fn': f'trl_docs_rewards:{n}'} for n in names])}"])
    return load_functions(cfg, columns=columns)


def _trl_scores(module, names: list[str], records: list[Rollout], global_step: int) -> torch.Tensor:
    """TRL's own GRPOTrainer._calculate_rewards on the batch, completions built as its
    _generate_and_score_completions builds them."""
    from trl import GRPOTrainer

    prompts = [r.prompt for r in records]
    if isinstance(prompts[0], list):
        completions = [[{"role": "assistant", "content": r.completion}] for r in records]
    else:
        completions = [r.completion for r in records]
    inputs = [{"prompt": r.prompt, **r.columns} for r in records]
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[getattr(module, n) for n in names],
        reward_processing_classes=[None] * len(names), reward_func_names=names, environments=None,
        state=SimpleNamespace(global_step=global_step), _log_completion_extra=lambda column, values: None,
        _log_metric=lambda name, value: None, async_loop=_loop(), args=SimpleNamespace(report_to=[]),
        _metrics={"train": {}}, model=SimpleNamespace(training=True))
    return GRPOTrainer._calculate_rewards(trainer, inputs, prompts, completions, [r.completion_ids for r in records])


def _loop():
    import asyncio
    import threading

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
def test_trl_docs_functions_score_what_trl_scores(docs_module, chat):
    names = CHAT_FUNCS if chat else TEXT_FUNCS
    trl_names = [n for n in names if n != "no_kwargs"]         # TRL passes every column: **kwargs is required there
    records = _records(chat)
    scored = score_records(_functions(names, columns={"ground_truth"}), records, "sum",
                           RewardState(global_step=7, max_steps=10))
    assert not scored.errors, scored.errors
    want = _trl_scores(docs_module, trl_names, _records(chat), global_step=7)
    got = torch.tensor([[scored.scores[n][j] for n in trl_names] for j in range(len(records))], dtype=torch.float32)
    assert torch.equal(got, want), (got, want)
    assert scored.scores["no_kwargs"] == [1.0] * 4                # gets the keywords it names
    assert scored.extra["length"] and scored.metrics["calls"] == 1.0
    assert scored.scores["scheduled"] == [7.0] * 4


def test_chat_completions_are_what_was_generated_after_a_prompt_that_ends_with_an_assistant_message():
    """TRL 1.16 renders such a prompt with the generation prompt after it (a new assistant turn, as rlflow's
    generator does) and passes the prompt as it is and the generated text alone: its older 'bootstrap' (the
    assistant message prefixed to the completion) would pay text the model never wrote."""
    r = _records(True)[0]
    r.prompt = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>"}]
    completions, columns = trl_inputs([r])
    assert completions == [[{"role": "assistant", "content": r.completion}]]
    assert columns["prompts"] == [[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>"}]]
    assert columns["ground_truth"] == ["4"] and columns["completion_ids"] == [[0]]


@pytest.mark.parametrize("name,expected", [
    ("needs_missing", "reward.functions[0].fn: trl_docs_rewards:needs_missing: needs argument 'solution', which is "
                      "neither a dataset column (the data has ['ground_truth'])"),
    ("positional_only", "reward.functions[0].fn: trl_docs_rewards:positional_only: argument 'completions' is "
                        "positional-only"),
])
def test_a_signature_the_data_cannot_satisfy_is_one_line_before_anything_runs(docs_module, name, expected):
    with pytest.raises(UserError) as e:
        _functions([name], columns={"ground_truth"})
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)
    _functions(["ground_truth_reward", "no_kwargs"], columns={"ground_truth"})    # these are satisfied


def test_trainer_state_has_every_field_of_transformers_trainer_state(tmp_path, monkeypatch):
    """A function reading `trainer_state.epoch` (or log_history, is_world_process_zero), as TRL users' schedules
    do, raised AttributeError: rlflow passed only global_step and max_steps. Every TrainerState field is there."""
    import dataclasses

    from transformers import TrainerState

    state = RewardState(global_step=5, max_steps=20)
    assert {f.name for f in dataclasses.fields(TrainerState)} <= {f.name for f in dataclasses.fields(state)}
    assert state.epoch == 0.25 and state.num_train_epochs == 1 and state.is_world_process_zero
    (tmp_path / "sched_rewards.py").write_text(
        "def by_epoch(completions, trainer_state, **kwargs):\n"
        "    return [float(trainer_state.epoch) + len(trainer_state.log_history)] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(TINY, [f"reward.functions={json.dumps([{'fn': 'sched_rewards:by_epoch'}])}"])
    records = _records(chat=False)
    score_records(load_functions(cfg, columns={"ground_truth"}), records, "sum", state=state)
    assert [r.rewards["by_epoch"] for r in records] == [0.25] * len(records)


# Written as TRL's docs write them; each test's module of its own (tmp_path), so its worker is its own too.
AUDIT = textwrap.dedent('''
    def acc_one(completions, log_metric, log_extra, **kwargs):
        log_metric("acc", 1.0)
        log_extra("why", ["one"] * len(completions))
        return [1.0] * len(completions)

    def acc_zero(completions, log_metric, log_extra, **kwargs):
        log_metric("acc", 0.0)
        log_extra("why", ["zero"] * len(completions))
        return [0.0] * len(completions)

    def env_reward(environments, **kwargs):
        return [env.reward for env in environments]

    def last_content(completions, **kwargs):
        return [float(len(c[-1]["content"])) for c in completions]

    def sees(completions, **kwargs):
        return [1.0 if "completion" in kwargs else 0.0 for _ in completions]
''')


def _audit(tmp_path, monkeypatch, names: list[str], config=TINY, columns=None):
    (tmp_path / "audit_rewards.py").write_text(AUDIT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(config, [f"reward.functions={json.dumps([{'fn': f'audit_rewards:{n}'} for n in names])}"])
    return load_functions(cfg, columns=columns)


def test_a_metric_two_functions_log_is_their_mean_as_in_trl(tmp_path, monkeypatch, capsys):
    """Two functions that log_metric one name: only the last value was kept (0.0), where TRL logs their mean; two
    that log_extra one column keep the last one's values, now said once naming both."""
    scored = score_records(_audit(tmp_path, monkeypatch, ["acc_one", "acc_zero"], columns={"ground_truth"}),
                           _records(chat=False), "sum")
    assert scored.metrics["acc"] == 0.5 and scored.extra["why"] == ["zero"] * 4
    said = [line for line in capsys.readouterr().err.splitlines() if "log_extra('why')" in line]
    assert len(said) == 1 and "'acc_one' and 'acc_zero'" in said[0], said


@pytest.mark.parametrize("column", ["prompts", "completion_ids", "log_metric", "trainer_state"])
def test_a_dataset_column_named_as_a_reward_keyword_is_refused_before_the_run(tmp_path, monkeypatch, column):
    """A column named as one of TRL's keywords was silently replaced by rlflow's own value (TRL raises
    TypeError "got multiple values"): now one line naming the column, before anything runs."""
    with pytest.raises(UserError) as e:
        _audit(tmp_path, monkeypatch, ["acc_one"], columns={column, "ground_truth"})
    assert str(e.value).startswith(f"data: column {column!r} is named as a keyword") and "\n" not in str(e.value)
    assert "rename it" in str(e.value)


def test_a_completion_column_is_not_forwarded_as_in_trl(tmp_path, monkeypatch):
    """TRL drops a dataset column named `completion` from what reward functions get; rlflow forwarded it."""
    functions = _audit(tmp_path, monkeypatch, ["sees"], columns={"completion", "ground_truth"})
    records = _records(chat=False)
    for r in records:
        r.columns["completion"] = "a reference"
    assert "completion" not in trl_inputs(records)[1]
    assert score_records(functions, records, "sum").scores["sees"] == [0.0] * 4


def test_a_failed_episode_costs_only_itself_the_healthy_ones_are_scored(tmp_path, monkeypatch):
    """An episode whose environment failed (env_error, no env_state, no messages) was handed to the functions as
    an empty placeholder: `env.reward` and `c[-1]["content"]` raised, and every completion of the batch lost
    those functions' scores. Now the functions see the healthy episodes only; the failed one scores None."""
    prompt = [{"role": "user", "content": "play"}]

    def episode(j: int, ok: bool) -> Rollout:
        return Rollout(group=j // 2, row=j // 2, prompt=prompt if ok else [], prompt_ids=[1], completion=f"done{j}",
                       completion_ids=[5, 6] if ok else [], logprobs=[0.0, 0.0] if ok else [], truncated=False,
                       columns={"ground_truth": "4"}, mask=[1, 1] if ok else [],
                       turns=[{"role": "assistant", "content": f"done{j}"}] if ok else [],
                       turn_rewards=[1.0] if ok else [], env_return=1.0 if ok else None,
                       env_error=None if ok else "reset raised RuntimeError: boom",
                       env_state={"reward": float(j)} if ok else None)

    records = [episode(0, True), episode(1, True), episode(2, False), episode(3, True)]
    scored = score_records(_audit(tmp_path, monkeypatch, ["env_reward", "last_content"]), records, "sum")
    assert not scored.errors, scored.errors
    assert scored.scores == {"env_reward": [0.0, 1.0, None, 3.0], "last_content": [5.0, 5.0, None, 5.0]}
    assert [r.reward for r in records] == [5.0, 6.0, None, 8.0]


def test_an_agents_function_may_require_environments(tmp_path, monkeypatch):
    """Under env.agent the functions get `environments` (each agent's state), but the preflight's signature
    check only knew it under env.factory and refused a function that requires it."""
    _audit(tmp_path, monkeypatch, ["env_reward"], config=TINY.parent / "agent.yaml", columns=set())

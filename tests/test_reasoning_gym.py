"""Prompts made by reasoning-gym tasks (data.reasoning_gym, tasks/core/procedural.py) and their rewards
(tasks/rewards/reasoning_gym.py), with the real reasoning-gym: deterministic splits, train apart from held-out, the
prompt the answer_format asks for; any task's own oracle answer, written in either form, scores 1.0 through the
task's own score_answer; the rewards give in TRL's GRPOTrainer what rlflow's scoring gives; a bad spec is one line.

Limitations these tests pin down (xfail strict: they turn into failures, to be cleared, once fixed):
- answer_is reads one line: multi-line answers (grids, move lists) and some quoted sentences cannot be read back
  that way (tags can);
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

from tasks.core import data, procedural
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.rewards.reasoning_gym import answer_reward, format_reward, read_answer
from tests.conftest import AT_LENGTH, ROOT, TINY

if TYPE_CHECKING:
    import torch

REWARDS = json.dumps([{"fn": "tasks.rewards.reasoning_gym:answer_reward", "weight": 1.0},
                      {"fn": "tasks.rewards.reasoning_gym:format_reward", "weight": 0.2}])

# At least ten tasks of different kinds, default configs: each row's oracle answer must score 1.0 in both forms.
TASKS = {
    "basic_arithmetic": "arithmetic", "chain_sum": "arithmetic", "decimal_arithmetic": "arithmetic",
    "gsm_symbolic": "word problem", "leg_counting": "word problem", "simple_equations": "algebra",
    "prime_factorization": "number theory", "base_conversion": "numbers", "calendar_arithmetic": "dates",
    "number_sorting": "list", "word_sorting": "list", "letter_counting": "words", "caesar_cipher": "cipher",
    "family_relationships": "logic", "knights_knaves": "logic", "shortest_path": "graph",
    "course_schedule": "graph", "maze": "game", "tsumego": "game", "sokoban": "game",
}
# The oracle answer spans lines (a grid, a list of moves): readable between tags, not as "The answer is X."
MULTI_LINE = ["mini_sudoku", "rotate_matrix", "tower_of_hanoi"]
# The oracle answer is a sentence ending in "."; answer_is strips trailing periods, the answer's own too.
SENTENCE = ["emoji_mystery"]      # sentences quoting other sentences (quotes, '?', ';' inside)
# Items made with Python's string hashing (sets), or drawn from the `random` module's global generator
# (list_functions): another process (PYTHONHASHSEED, an unseeded global generator) would make other items.
HASH_SEEDED = ["isomorphic_strings", "ransom_note", "list_functions"]
DETERMINISTIC = ["basic_arithmetic", "chain_sum", "gsm_symbolic", "leg_counting", "number_sorting", "maze",
                 "knights_knaves", "family_relationships"]


@pytest.fixture(scope="module", autouse=True)
def _reasoning_gym():
    """reasoning-gym's import (~3 s, once) in the setup, not in the first test's time."""
    import reasoning_gym

    return reasoning_gym


def _config(task: str, *extra: str, size: int = 6, eval_size: int = 3, answer_format: str = "tags", config=None):
    spec = {"task": task, "size": size, "eval_size": eval_size, "answer_format": answer_format, "config": config or {}}
    return load_config(TINY, ["data.path=null", f"data.reasoning_gym={json.dumps(spec)}", f"reward.functions={REWARDS}",
                              *extra])


def _splits(cfg) -> tuple[list[dict], list[dict]]:
    return data.load_prompts(cfg).to_list(), data.load_prompts(cfg, split="eval").to_list()


def _columns(rows: list[dict]) -> dict[str, list]:
    return {k: [r[k] for r in rows] for k in ("answer", "question", "metadata", "reasoning_gym", "answer_format")}


def _written(answer: str, answer_format: str) -> str:
    """A reply giving `answer` in the form the prompt asks for."""
    if answer_format == "tags":
        return f"Let me work it out step by step.\n<answer>{answer}</answer>"
    return f"Let me work it out step by step. The answer is {answer}" + ("" if answer.endswith(".") else ".")


def _oracle_scores(task: str, answer_format: str) -> list[float]:
    train, held_out = _splits(_config(task, answer_format=answer_format))
    rows = train + held_out
    return answer_reward([_written(r["answer"], answer_format) for r in rows], **_columns(rows))


# ---- the splits ---------------------------------------------------------------------------------------------------

def test_splits_are_the_size_asked_apart_and_deterministic():
    cfg = _config("chain_sum", size=12, eval_size=5)
    train, held_out = _splits(cfg)
    assert (len(train), len(held_out)) == (12, 5)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}
    procedural._splits.cache_clear()                             # built again, not read from the memo ...
    import shutil

    from tasks.core.paths import cache_root

    shutil.rmtree(cache_root() / "reasoning-gym")                # ... nor from this machine's copy
    assert _splits(cfg) == (train, held_out)
    moved = load_config(TINY, ["data.path=null", 'data.reasoning_gym={"task": "chain_sum", "size": 12, '
                                                 '"eval_size": 5, "seed": 7}'])
    assert _splits(moved)[0] != train and _splits(moved)[1] != held_out
    assert {json.loads(r["reasoning_gym"])["task"] for r in train + held_out} == {"chain_sum"}
    assert {r["answer_format"] for r in train + held_out} == {"tags"}


def test_training_never_sees_a_held_out_question_even_in_a_small_space():
    """gcd of two numbers in 1..3 has 9 questions: the training stream repeats held-out ones, which are left out."""
    import reasoning_gym

    config = {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 3}
    train, held_out = _splits(_config("gcd", size=20, eval_size=3, config=config))
    held = {r["question"] for r in held_out}
    stream = reasoning_gym.create_dataset("gcd", **config, seed=0, size=80)
    assert held & {e["question"] for e in stream}                  # there was something to leave out
    assert len(train) == 20 and not held & {r["question"] for r in train}


def test_training_never_sees_a_held_out_questions_twin():
    """A sum with its terms swapped is the held-out sum (`Calculate 2 + 10.` beside `Calculate 10 + 2.`): the training
    split leaves those out too, and the held-out split is as it was (its questions are the held-out seed's)."""
    import reasoning_gym

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
              "allow_parentheses": False, "allow_negation": False}
    train, held_out = _splits(_config("basic_arithmetic", size=60, eval_size=10, config=config))

    def terms(question: str) -> frozenset:
        return frozenset(collections.Counter(re.findall(r"\d+", question)).items())

    held = {terms(r["question"]) for r in held_out}
    stream = reasoning_gym.create_dataset("basic_arithmetic", **config, seed=0, size=240)
    assert any(terms(e["question"]) in held and e["question"] not in {r["question"] for r in held_out}
               for e in stream)                                  # twins were there to leave out
    assert len(train) == 60 and not held & {terms(r["question"]) for r in train}
    again = reasoning_gym.create_dataset("basic_arithmetic", **config, seed=procedural.HELD_OUT_SEED, size=100)
    firsts = {}
    for e in again:
        firsts.setdefault(terms(e["question"]), e["question"])
    assert [r["question"] for r in held_out] == list(firsts.values())[:10]      # the held-out seed's, one a problem


def test_the_prompt_is_chat_messages_ending_with_the_answer_formats_instruction():
    for answer_format in ("tags", "answer_is"):
        train, held_out = _splits(_config("leg_counting", answer_format=answer_format))
        for r in train + held_out:
            [message] = r["prompt"]
            assert message["role"] == "user"
            assert message["content"] == f"{r['question']}\n\n{procedural.INSTRUCTIONS[answer_format]}"
            assert r["answer_format"] == answer_format
    train, _ = _splits(_config("leg_counting", "data.system_prompt=You are a careful counter.",
                               'data.reasoning_gym.instruction="Reply with a number only."'))
    assert train[0]["prompt"][0] == {"role": "system", "content": "You are a careful counter."}
    assert train[0]["prompt"][1]["content"].endswith("\n\nReply with a number only.") and len(train[0]["prompt"]) == 2
    renamed = data.load_prompts(_config("leg_counting", "data.prompt_column=messages"))
    assert "messages" in renamed.column_names and "prompt" not in renamed.column_names


def test_eval_path_still_names_the_held_out_file(tmp_path):
    (tmp_path / "held.jsonl").write_text(json.dumps({"prompt": "How many legs does a cat have?", "answer": "4"}) + "\n")
    cfg = _config("leg_counting", "eval.every=5", f"eval.path={tmp_path / 'held.jsonl'}")
    assert data.load_prompts(cfg, split="eval")["answer"] == ["4"]
    assert len(data.load_prompts(cfg)) == 6


@pytest.mark.parametrize("task", ["chain_sum", "leg_counting", "gsm_symbolic", "number_sorting", "maze",
                                  "knights_knaves", "family_relationships", "shortest_path"])
def test_metadata_round_trips_into_what_score_answer_needs(task):
    """Each row is the task's item (found again by its source_index, at the split's seed): the question, the answer,
    the metadata through JSON, and score_answer on that row's columns gives what it gives on the item itself."""
    import reasoning_gym

    cfg = _config(task, size=4, eval_size=2)
    train, held_out = _splits(cfg)
    tries = procedural.TRIES
    for rows, seed, size in ((train, 0, tries * 4), (held_out, procedural.HELD_OUT_SEED, tries * 2)):
        items = reasoning_gym.create_dataset(task, seed=seed, size=size)
        for r in rows:
            meta = procedural.untagged(json.loads(r["metadata"]))
            item = items[meta["source_index"]]
            assert (r["question"], r["answer"]) == (item["question"], str(item["answer"]))
            assert meta == item["metadata"]                 # tuples included
            assert answer_reward([f"<answer>{r['answer']}</answer>"], **_columns([{**r, "answer_format": "tags"}])) \
                == [items.score_answer(str(item["answer"]), item)] == [1.0]


def test_grid_metadata_survives_json():
    """rearc's score_answer compares a parsed grid (tuples) with metadata['output'] by ==: the metadata column keeps
    tuples tuples."""
    assert min(_oracle_scores("rearc", "tags")) == 1.0


@AT_LENGTH
@pytest.mark.slow
def test_the_splits_are_the_same_in_a_fresh_process(tmp_path):
    """Another interpreter (another PYTHONHASHSEED) makes the same rows, also for the tasks whose items depend on
    Python's string hashing (reasoning-gym iterates over sets there): the splits are built with PYTHONHASHSEED=0."""
    script = ("import json, sys; from tasks.core import procedural\n"
              "out = {t: procedural._splits(t, '{}', 0, 6, 3, 'tags', procedural.INSTRUCTIONS['tags'], None)\n"
              "       for t in sys.argv[1:]}\n"
              "print(json.dumps(out))")
    tasks = [*DETERMINISTIC[:2], *HASH_SEEDED]       # each build is a child process with reasoning-gym's import
    runs = [json.loads(subprocess.run([sys.executable, "-c", script, *tasks], cwd=ROOT,
                                      env={**os.environ, "PYTHONHASHSEED": seed, "RLFLOW_CACHE": str(tmp_path / seed)},
                                      capture_output=True, text=True, check=True).stdout.splitlines()[-1])
            for seed in ("1", "2")]                      # (each its own cache: built in each, not read back)
    here = {t: procedural._splits(t, "{}", 0, 6, 3, "tags", procedural.INSTRUCTIONS["tags"], None)
            for t in tasks}
    for task in tasks:
        assert runs[0][task] == runs[1][task] == json.loads(json.dumps(here[task])), task


# ---- the rewards: any task -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", sorted(TASKS), ids=[f"{t}({k})" for t, k in sorted(TASKS.items())])
@pytest.mark.parametrize("answer_format", ["tags", "answer_is"])
def test_each_tasks_oracle_answer_scores_one_and_a_wrong_one_less(task, answer_format):
    train, held_out = _splits(_config(task, answer_format=answer_format))
    rows = train + held_out
    columns = _columns(rows)
    assert answer_reward([_written(r["answer"], answer_format) for r in rows], **columns) == [1.0] * len(rows)
    # as TRL passes chat completions
    chat = [[{"role": "assistant", "content": _written(r["answer"], answer_format)}] for r in rows]
    assert answer_reward(chat, **columns) == [1.0] * len(rows)
    wrong = answer_reward([_written("zq", answer_format)] * len(rows), **columns)
    assert all(0.0 <= w < 1.0 for w in wrong), wrong
    unreadable = answer_reward([r["answer"] for r in rows], **columns)       # the answer, not in the asked form
    assert unreadable == [0.0] * len(rows)

    fmt = [answer_format] * len(rows)
    assert format_reward([_written(r["answer"], answer_format) for r in rows], answer_format=fmt) == [1.0] * len(rows)
    assert format_reward(chat, answer_format=fmt) == [1.0] * len(rows)
    assert format_reward([r["answer"] for r in rows], answer_format=fmt) == [0.0] * len(rows)          # missing
    twice = [_written(r["answer"], answer_format) + "\n" + _written(r["answer"], answer_format) for r in rows]
    assert format_reward(twice, answer_format=fmt) == [0.0] * len(rows)                                # double
    other = "answer_is" if answer_format == "tags" else "tags"
    assert format_reward([_written(r["answer"], other) for r in rows], answer_format=fmt) == [0.0] * len(rows)


@pytest.mark.parametrize("task", MULTI_LINE)
def test_a_multi_line_answer_reads_back_between_tags(task):
    train, held_out = _splits(_config(task))
    assert any("\n" in r["answer"] for r in train + held_out)
    assert _oracle_scores(task, "tags") == [1.0] * len(train + held_out)


def test_answer_is_reads_back_a_sentence_ending_in_a_full_stop():
    """sentence_reordering's answers are sentences: "The answer is X." is scored with and without X's full stop."""
    assert min(_oracle_scores("sentence_reordering", "answer_is")) == 1.0


@pytest.mark.parametrize("task", SENTENCE)
def test_answer_is_reads_back_sentence_answers(task):
    """Sentences quoting other sentences (a leading quote, a full stop of their own): read back as written too
    (readings; an expected failure until 2026-12-06)."""
    assert min(_oracle_scores(task, "answer_is")) == 1.0


@pytest.mark.parametrize("answer_format", ["answer_is", "final"])
@pytest.mark.parametrize("task", MULTI_LINE)
def test_an_answer_format_of_one_line_is_refused_for_answers_of_several(task, answer_format):
    """answer_is and final read one line: a grid or a list of moves would never be read back (every reward 0, the
    run training on nothing); it was accepted."""
    with pytest.raises(UserError, match=rf"data\.reasoning_gym\.answer_format: {answer_format} reads an answer of one "
                                        rf"line, and task '{task}' has answers of several .*; expected tags"):
        _splits(_config(task, answer_format=answer_format))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_final_reads_each_tasks_oracle_answer_alone_or_said(task):
    """final (the answer only, read leniently): the oracle answer alone, or after "The answer is", scores 1.0 where
    it is one line with no "=" or ": " of its own (else it reads as its own right side); "zq" scores less."""
    train, held_out = _splits(_config(task, answer_format="final"))
    rows = [r for r in train + held_out if "\n" not in r["answer"] and "=" not in r["answer"]
            and ": " not in r["answer"]]
    if not rows:
        pytest.skip(f"{task}: every answer spans lines or holds '=' / ': '")
    columns = _columns(rows)
    assert answer_reward([r["answer"] for r in rows], **columns) == [1.0] * len(rows)
    assert answer_reward([f"The answer is {r['answer']}" for r in rows], **columns) == [1.0] * len(rows)
    assert all(w < 1.0 for w in answer_reward(["zq"] * len(rows), **columns))


def test_final_reads_the_last_lines_right_side_or_its_last_number():
    rows = {"answer": ["12"] * 7, "question": ["Calculate 7 + 5."] * 7, "metadata": ["{}"] * 7,
            "reasoning_gym": ['{"config": {}, "task": "basic_arithmetic"}'] * 7, "answer_format": ["final"] * 7}
    replies = ["12", "7 + 5 = 12", "The sum of 7 and 5 is 12.", "The answer is 12.", "7 + 5 = 13\n12 + 0 = 12",
               "12 13", "The words are: 12"]
    scores = answer_reward(replies, **rows)
    assert scores[:5] + scores[6:] == [1.0] * 6 and scores[5] < 1.0      # "12 13": the last number only (13)
    assert [read_answer(r, "final") for r in replies[:3]] == ["12", "12", "The sum of 7 and 5 is 12"]
    assert read_answer("05:44", "final") == "05:44" and read_answer("", "final") is None
    # format: one line, its answer where the form puts it and at most four words, not a sentence with a number
    assert format_reward(replies, answer_format=rows["answer_format"]) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(("task", "right", "wrong"), [("chain_sum", "3", ["13", "-3", "33"]),
                                                     ("basic_arithmetic", "3", ["13", "-3"]),
                                                     ("letter_counting", "1", ["10", "11"])])
def test_a_wrong_answer_holding_the_right_one_is_wrong_unless_partial_credit_is_asked(task, right, wrong):
    """reasoning-gym's checkers pay len(right) / len(read) for a read answer that contains the right one ("13" for
    3: 0.5); answer_reward pays correctness alone, the checker's score only with partial_credit=True."""
    n = len(wrong) + 1
    rows = {"answer": [right] * n, "question": ["q"] * n, "metadata": ["{}"] * n, "answer_format": ["final"] * n,
            "reasoning_gym": [json.dumps({"config": {}, "task": task})] * n}
    replies = [right, *wrong]
    assert answer_reward(replies, **rows) == [1.0] + [0.0] * len(wrong)
    graded = answer_reward(replies, **rows, partial_credit=True)
    assert graded[0] == 1.0 and all(0.0 < g < 1.0 for g in graded[1:])


def test_format_reward_and_answer_reading_on_hand_written_replies():
    fmt = ["tags"] * 5
    replies = ["<answer>12</answer>", "think... <answer> 12 </answer>", "<answer></answer>",
               "<answer>12</answer> and then more", "<answer>1</answer><answer>12</answer>"]
    assert format_reward(replies, answer_format=fmt) == [1.0, 1.0, 0.0, 0.0, 0.0]
    rows = {"answer": ["12"] * 5, "question": ["Calculate 7 + 5."] * 5, "metadata": ["{}"] * 5,
            "reasoning_gym": ['{"config": {}, "task": "basic_arithmetic"}'] * 5}
    assert answer_reward(replies, **rows, answer_format=fmt) == [1.0, 1.0, 0.0, 1.0, 1.0]    # the last tags count
    fmt = ["answer_is"] * 5
    replies = ["7 + 5 = 12. The answer is 12.", "The answer is: **12**.", "the answer is 12", "The answer is 12. Done.",
               "The answer is 11. No wait, the answer is 12."]
    # (the third has no full stop: a reply cut off by the length limit looks like that)
    assert format_reward(replies, answer_format=fmt) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert [read_answer(r, "answer_is") for r in replies] == ["12", "12", "12", "12. Done", "12"]   # the last one said
    scores = answer_reward(replies, **rows, answer_format=fmt)
    assert scores[:3] == [1.0] * 3 and scores[3] < 1.0 and scores[4] == 1.0
    assert read_answer("no answer here", "answer_is") is None and read_answer("<answer> </answer>", "tags") == ""


# ---- the rewards through TRL's own code ----------------------------------------------------------------------------

def _trl_rewards(inputs: list[dict], completions: list) -> torch.Tensor:
    """TRL's GRPOTrainer._calculate_rewards on dataset rows as its dataloader hands them over (one per generation),
    conversational completions built as its _generate_and_score_completions builds them."""
    import asyncio
    import threading

    import torch
    from trl import GRPOTrainer

    from tasks.rewards import reasoning_gym as rg

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=[rg.answer_reward, rg.format_reward], reward_processing_classes=[None, None],
        reward_func_names=["answer_reward", "format_reward"], environments=None,
        state=SimpleNamespace(global_step=1), _log_completion_extra=lambda column, values: None,
        _log_metric=lambda name, value: None, async_loop=loop, args=SimpleNamespace(report_to=[]),
        _metrics={"train": {}}, model=SimpleNamespace(training=True))
    try:
        return GRPOTrainer._calculate_rewards(trainer, inputs, [x["prompt"] for x in inputs], completions,
                                              [[0]] * len(inputs))
    finally:
        loop.call_soon_threadsafe(loop.stop)


@pytest.mark.slow
def test_trls_grpo_trainer_scores_what_rlflow_scores():
    """Rows of both answer_formats from the data source; per row four replies (right in form, right out of form,
    wrong in form, right twice). TRL's per-function rewards and its weighted nansum equal rlflow's score_records."""
    import torch
    from trl.data_utils import is_conversational

    from tasks.core.contracts import Rollout
    from tasks.scoring.functions import load_functions, score_records
    from tasks.scoring.worker import RewardState

    cfg = _config("basic_arithmetic", size=3, eval_size=2)
    rows = data.load_prompts(cfg).to_list() + data.load_prompts(_config("basic_arithmetic", size=3, eval_size=2,
                                                                         answer_format="answer_is")).to_list()
    assert all(is_conversational(r) for r in rows)
    inputs, texts = [], []
    for r in rows:
        right = _written(r["answer"], r["answer_format"])
        other = "answer_is" if r["answer_format"] == "tags" else "tags"
        for text in (right, _written(r["answer"], other), _written("-1.5", r["answer_format"]), right + "\n" + right):
            inputs.append(r)
            texts.append(text)
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    want = _trl_rewards(inputs, completions)

    records = [Rollout(group=j // 4, row=j // 4, prompt=r["prompt"], prompt_ids=[0], completion=t, completion_ids=[0],
                       logprobs=[0.0], truncated=False, columns={k: v for k, v in r.items() if k != "prompt"})
               for j, (r, t) in enumerate(zip(inputs, texts))]
    functions = load_functions(cfg, columns=set(rows[0]) - {"prompt"})
    scored = score_records(functions, records, "sum", RewardState(global_step=1, max_steps=2))
    assert not scored.errors, scored.errors
    got = torch.tensor([[r.rewards["answer_reward"], r.rewards["format_reward"]] for r in records])
    assert torch.equal(got, want), (got, want)
    weights = torch.tensor([1.0, 0.2])
    assert torch.allclose(torch.tensor([r.reward for r in records]), (want * weights).nansum(dim=1))
    assert want[0::4, 0].tolist() == [1.0] * len(rows) and want[0::4, 1].tolist() == [1.0] * len(rows)
    assert want[3::4, 1].tolist() == [0.0] * len(rows) and want[1::4, 1].tolist() == [0.0] * len(rows)


# ---- bad specs: one line naming the field --------------------------------------------------------------------------

BAD_SPECS = {
    "unknown task": ({"task": "nosuch_task"}, "data.reasoning_gym.task: unknown reasoning-gym task 'nosuch_task' "
                     "(106 tasks; e.g. basic_arithmetic"),
    "misspelt task": ({"task": "chain_sums"}, "data.reasoning_gym.task: unknown reasoning-gym task 'chain_sums'; "
                      "did you mean 'chain_sum'? (similar: decimal_chain_sum)"),
    "near miss": ({"task": "basic_arithmatic"}, "data.reasoning_gym.task: unknown reasoning-gym task "
                  "'basic_arithmatic'; did you mean 'basic_arithmetic'?"),
    "unknown config key": ({"task": "chain_sum", "config": {"max_termz": 3}},
                           "data.reasoning_gym.config.max_termz: task 'chain_sum' has no such setting; did you mean "
                           "'max_terms'? (it has: allow_negation, max_digits, max_terms, min_digits, min_terms)"),
    "config.seed": ({"task": "chain_sum", "config": {"seed": 3}},
                    "data.reasoning_gym.config.seed: set data.reasoning_gym.seed instead"),
    "config.size": ({"task": "chain_sum", "config": {"size": 30}},
                    "data.reasoning_gym.config.size: set data.reasoning_gym.size instead"),
    "refused by validate()": ({"task": "chain_sum", "config": {"min_terms": 5, "max_terms": 2}},
                              "data.reasoning_gym.config: task 'chain_sum' refuses {\"max_terms\": 2, \"min_terms\": "
                              "5}: max_terms must be >= min_terms"),
    "wrong type for validate()": ({"task": "chain_sum", "config": {"min_terms": "many"}},
                                  "data.reasoning_gym.config: task 'chain_sum' refuses {\"min_terms\": \"many\"}: "),
    "space too small": ({"task": "count_bits", "config": {"min_n": 1, "max_n": 3}, "size": 5, "eval_size": 20},
                        "data.reasoning_gym.eval_size: task 'count_bits' with this config gave only 3 different "
                        "held-out problems in 200 items (eval_size 20); expected eval_size smaller or the task's "
                        "space larger"),
    "no room to train": ({"task": "count_bits", "config": {"min_n": 1, "max_n": 3}, "size": 5, "eval_size": 3},
                         "data.reasoning_gym: task 'count_bits' with this config gave only 0 training items outside "
                         "the 3 held-out ones and their twins (the same words and numbers in another order) in 50 "
                         "tries (size 5)"),
    "fails in the generator": ({"task": "simple_equations", "config": {"operators": ["+", "-"]}, "size": 5,
                                "eval_size": 5},
                               "data.reasoning_gym.config: task 'simple_equations' fails to make items with "
                               "{\"operators\": [\"+\", \"-\"]}: The number of weights does not match the population"),
    # the config models
    "size zero": ({"task": "chain_sum", "size": 0}, "config: data.reasoning_gym.size: input should be greater than or "
                  "equal to 1"),
    "unknown answer_format": ({"task": "chain_sum", "answer_format": "boxed"},
                              "config: data.reasoning_gym.answer_format: input should be 'tags', 'answer_is' or "
                              "'final'"),
    "unknown section key": ({"task": "chain_sum", "sizes": 4}, "config: unknown key 'data.reasoning_gym.sizes'"),
    "no task": ({"size": 4}, "config: data.reasoning_gym.task"),
    # composite: its datasets as YAML writes them (a traceback from reasoning-gym's validate() before)
    "composite entry not a mapping": ({"task": "composite", "config": {"datasets": [5]}},
                                      "data.reasoning_gym.config.datasets[0]: 5, expected {name: <task>, weight: "),
    "composite unknown task": ({"task": "composite", "config": {"datasets": [{"name": "chain_summ"}]}},
                               "data.reasoning_gym.config.datasets[0].name: unknown reasoning-gym task 'chain_summ'; "
                               "did you mean 'chain_sum'?"),
    "composite weight": ({"task": "composite", "config": {"datasets": [{"name": "chain_sum", "weight": "x"}]}},
                         "data.reasoning_gym.config.datasets[0].weight: 'x', expected a number above 0"),
    "composite setting": ({"task": "composite", "config": {"datasets": [{"name": "chain_sum",
                                                                           "config": {"max_termz": 2}}]}},
                          "data.reasoning_gym.config.datasets[0].config.max_termz: task 'chain_sum' has no such "
                          "setting; did you mean 'max_terms'?"),
    "composite empty": ({"task": "composite", "config": {"datasets": []}},
                        "data.reasoning_gym.config: task 'composite' refuses {\"datasets\": []}: Must specify at "
                        "least one dataset"),
}


@pytest.mark.parametrize("name", list(BAD_SPECS))
def test_a_bad_spec_is_one_line_naming_the_field(name):
    spec, expected = BAD_SPECS[name]
    with pytest.raises(UserError) as e:
        cfg = load_config(TINY, ["data.path=null", f"data.reasoning_gym={json.dumps(spec)}"])
        data.load_prompts(cfg)
    assert "\n" not in str(e.value) and str(e.value).startswith(expected), str(e.value)


def test_a_generator_that_does_not_end_is_one_line(monkeypatch):
    """base_conversion with min_base == max_base loops forever in reasoning-gym 0.1.25 (it draws a target base
    until it differs from the source's): the item's time limit makes it one line, and a caller's own alarm
    (pytest-timeout's, say) is put back after each item."""
    import signal

    from tasks.core import procedural

    monkeypatch.setattr(procedural, "ITEM_SECONDS", 0.5)
    fired = []
    before = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    signal.setitimer(signal.ITIMER_REAL, 600)
    try:
        with pytest.raises(UserError) as e:
            procedural._build("base_conversion", json.dumps({"min_base": 2, "max_base": 2}), 0, 3, 3, "final",
                              "Reply with the final answer only.", None)
        left, _ = signal.setitimer(signal.ITIMER_REAL, 0)
    finally:
        signal.signal(signal.SIGALRM, before)
    assert str(e.value).startswith("data.reasoning_gym.config: task 'base_conversion' did not make item 0 in 0.5 s "
                                   "with {\"max_base\": 2, \"min_base\": 2}: its generator does not end"), str(e.value)
    assert 500 < left <= 600 and not fired


@pytest.mark.parametrize("overrides", [["data.reasoning_gym={task: chain_sum}"], ["data.path=null"]],
                         ids=["both", "neither"])
def test_exactly_one_of_data_path_and_reasoning_gym(overrides):
    with pytest.raises(UserError, match=r"^config: data: set exactly one of path \(a data file or hub dataset\) "
                                        r"and reasoning_gym"):
        load_config(TINY, overrides)


# ---- a run on a reasoning-gym task ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_run_trains_on_a_task_and_evaluates_on_its_held_out_split(prefect_api, tmp_path, monkeypatch):
    """One iteration on chain_sum with the task's rewards; the base model and v1 evaluated on the held-out split
    (greedy, pass decided by answer_reward alone); the scored rollouts carry the task's columns."""
    monkeypatch.chdir(tmp_path)
    spec = {"task": "chain_sum", "config": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
            "size": 16, "eval_size": 4, "answer_format": "answer_is"}
    overrides = ["run.name=rg", "run.iterations=1", "data.path=null", f"data.reasoning_gym={json.dumps(spec)}",
                 f"reward.functions={REWARDS}", "generate.prompts_per_iteration=4", "generate.num_generations=2",
                 "generate.max_completion_length=8", "eval.every=1", "eval.baseline=true", "eval.greedy=true",
                 "eval.pass_reward=answer_reward", "eval.metric=greedy_pass_at_1", "eval.num_generations=2",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0"]
    cfg = load_config(TINY, overrides)
    from flows.training import train_flow
    from tasks.core import layout
    from tasks.core.store import Store

    summary = train_flow(str(TINY), overrides)
    assert summary["iterations_completed"] == 1
    assert set(summary["held_out"]) == {"metric", "0", "1"} and summary["held_out"]["metric"] == "eval/greedy_pass_at_1"
    store = Store.open(cfg.store)
    for it in (0, 1):
        metrics = store.manifest(layout.evaluation("rg", it))["meta"]["metrics"]
        assert {"eval/greedy_pass_at_1", "eval/greedy_reward_mean", "eval/pass_at_1", "eval/prompts"} <= set(metrics)
        assert metrics["eval/prompts"] == 4.0
    scored = [json.loads(line) for line in store._get_bytes(f"{layout.rewards('rg', 1)}/rollouts.jsonl").splitlines()]
    assert len(scored) == 8 and all(set(r["rewards"]) == {"answer_reward", "format_reward"} for r in scored)
    held_out = set(data.load_prompts(cfg, split="eval")["question"])
    assert all(r["columns"]["answer_format"] == "answer_is" and r["columns"]["question"] not in held_out
               for r in scored)


def test_a_large_split_is_made_once_per_machine_and_says_so(capsys, monkeypatch):
    """Issue 44 item 11: a held-out size inside the allowed range took minutes to make in every stage process, saying
    nothing; now it says what it is making, once, and every later process reads it back."""
    from tasks.core.paths import cache_root

    monkeypatch.setattr(procedural, "SAY_FROM", 10)
    spec = ("chain_sum", "{}", 5, 12, 4, "tags", procedural.INSTRUCTIONS["tags"], None)
    procedural._splits.cache_clear()
    made = procedural._splits(*spec)
    assert capsys.readouterr().err == (f"data.reasoning_gym: making 12 training and 4 held-out items of chain_sum "
                                       f"(once on this machine; kept in {cache_root() / 'reasoning-gym'})\n")
    procedural._splits.cache_clear()
    assert procedural._splits(*spec) == made and capsys.readouterr().err == ""


# ---- found running every task (2026-12-06: all 106 of reasoning-gym 0.1.25, three answer formats) ----------------

@pytest.mark.parametrize("task", ["bf", "game_of_life", "rubiks_cube"])
def test_every_task_builds_its_splits(task):
    """bf's generator prints dots without a newline: they began the JSON line the child making the splits answers
    with (a JSONDecodeError's traceback; the child is used where hashing is randomized, as in this process).
    game_of_life's boards (as many live cells each) and rubiks_cube's stickers share twin_key's token counts: every
    training item was a held-out one's "twin", and the task was refused as too small."""
    assert sys.flags.hash_randomization                  # (the child's path, as a run's)
    train, held_out = _splits(_config(task, size=12, eval_size=6))
    assert (len(train), len(held_out)) == (12, 6)
    assert not {r["question"] for r in train} & {r["question"] for r in held_out}


def test_a_small_tasks_space_is_still_refused_rather_than_its_twins_trained_on():
    """(The exact-question rule is for tasks whose questions twin_key cannot tell apart, not a small space.)"""
    with pytest.raises(UserError, match="gave only .* training items outside the 10 held-out ones and their twins"):
        _splits(_config("lcm", size=60, eval_size=10, config={"min_numbers": 2, "max_numbers": 2,
                                                              "min_value": 1, "max_value": 4}))


@pytest.mark.parametrize("task", ["sentence_reordering", "emoji_mystery", "cryptarithm", "codeio"])
def test_answers_with_quotes_stops_or_equals_of_their_own_read_back_in_the_one_line_forms(task):
    """The oracle answer said as asked scored 0 where it began with a quote or ended with its own full stop
    (answer_is and final cut them) or held "=" or ": " (final read only its right side: `A=7,G=0` -> `0`)."""
    for fmt in ("answer_is", "final"):
        train, held_out = _splits(_config(task, size=12, eval_size=6, answer_format=fmt))
        rows = train + held_out
        columns = _columns(rows)
        assert answer_reward([_written(r["answer"], fmt) for r in rows], **columns) == [1.0] * len(rows), fmt
        if fmt == "final":
            assert answer_reward([r["answer"] for r in rows], **columns) == [1.0] * len(rows)
            assert all(w < 1.0 for w in answer_reward(["zq"] * len(rows), **columns))


def test_final_form_allows_an_answer_as_many_words_as_the_rows():
    """FINAL_WORDS (4) alone never paid the form on tasks whose answers are longer (knights_knaves' sentence)."""
    reply = "Victoria is a knight, and Jacob is a knave."
    assert format_reward([reply], answer_format=["final"], answer=[reply]) == [1.0]
    assert format_reward([reply], answer_format=["final"], answer=["12"]) == [0.0]
    assert format_reward([reply], answer_format=["final"]) == [0.0]


def test_final_reads_a_whole_line_only_for_answers_a_lenient_reading_would_cut():
    """The whole last line as a reading paid "12 + 5 = 17" for 12 where the checker reads a line's first number
    (gsm_symbolic): it is one only where the row's answer holds "=" or ": ", a quote or its own full stop."""
    rows = {"answer": ["12"] * 3, "question": ["x"] * 3, "metadata": ["{}"] * 3, "answer_format": ["final"] * 3,
            "reasoning_gym": ['{"config": {}, "task": "gsm_symbolic"}'] * 3}
    assert answer_reward(["12 + 5 = 17", "He had 12 apples, so 12 - 4 = 8", "5 + 7 = 12"], **rows) == [0.0, 0.0, 1.0]


def test_a_reading_with_several_numbers_is_one_guess_not_two():
    """gsm_symbolic's checker reads a reading's first number, and the readings gave it the last one too: "21 or
    20" and "20 or 21" were both paid for 20. Where the row's answer is one number, the last number only."""
    rows = {"answer": ["20"], "question": ["x"], "metadata": ["{}"], "answer_format": ["final"],
            "reasoning_gym": ['{"config": {}, "task": "gsm_symbolic"}']}
    assert answer_reward(["20 or 21", "21 or 20", "20"], **{k: v * 3 for k, v in rows.items()}) == [0.0, 1.0, 1.0]
    rows["answer_format"] = ["answer_is"]
    assert answer_reward(["The answer is 20 or 21.", "The answer is 20."], **{k: v * 2 for k, v in rows.items()}) \
        == [0.0, 1.0]


def test_unclosed_answer_tags_are_read_in_linear_time_and_nested_tags_are_out_of_form():
    """Many "<answer>" never closed: each was searched on to the end (64 KB took ~4 s, 1 MB ~18 min, the stage's
    whole batch lost at its timeout); <answer><answer>12</answer></answer> was in form."""
    probe = ("from tasks.rewards.reasoning_gym import format_reward, read_answer\n"
             "flood = '<answer>' * 100_000\n"
             "print(format_reward([flood, flood + '1</answer>'], answer_format=['tags'] * 2),\n"
             "      read_answer(flood, 'tags'), read_answer('<answer>7</answer>' + flood, 'tags'))\n")
    # (a child, killed if it runs on: the old search never returned to Python, so no alarm could stop it; it
    # takes milliseconds now, ~10^4 times under the limit)
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["[0.0,", "0.0]", "None", "7"], done.stderr[-2000:]
    assert format_reward(["<answer><answer>12</answer></answer>", "<answer>12</answer>"],
                         answer_format=["tags"] * 2) == [0.0, 1.0]


def test_held_out_problems_are_all_different():
    """The recipe's sums (two terms of 1-2 digits) repeat in the generator's stream: its first 100 held-out items
    were 85 problems, 1-digit sums weighed twice and `eval/prompts` saying 100. The held-out split is now 100
    different problems (no two twins either), and the training split still leaves all of them out."""
    import reasoning_gym

    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+"],
              "allow_parentheses": False, "allow_negation": False}
    stream = reasoning_gym.create_dataset("basic_arithmetic", **config, seed=procedural.HELD_OUT_SEED, size=100)
    assert len({procedural.twin_key(e["question"]) for e in stream}) < 100          # the stream repeats itself
    train, held_out = _splits(_config("basic_arithmetic", size=200, eval_size=100, config=config))
    keys = [procedural.twin_key(r["question"]) for r in held_out]
    assert len(held_out) == len(set(keys)) == 100
    assert not set(keys) & {procedural.twin_key(r["question"]) for r in train}


def test_a_task_twin_key_cannot_tell_apart_makes_its_held_out_split_without_visiting_ten_times_as_many(monkeypatch):
    """game_of_life's boards share twin_key's token counts: its held-out split is exact questions, found among the
    first few times eval_size items, not after all TRIES x eval_size (ten times the items made, each build)."""
    made, items = [], procedural._items

    def counted(*args):
        for entry in items(*args):
            made.append(entry)
            yield entry
    monkeypatch.setattr(procedural, "_items", counted)
    held_out = procedural._held_out("game_of_life", {}, procedural.HELD_OUT_SEED, 6)
    assert len({r["question"] for r in held_out}) == 6 and len(made) <= 3 * 6


def test_a_composite_of_tasks_written_in_yaml_makes_prompts_its_tasks_score():
    """reasoning-gym's composite task takes its own DatasetSpec objects; from a config its datasets are mappings,
    which it refused with a traceback. Now each is made one (weight 1 and no config by default), and each row is
    scored by its own task's checker (the reward makes the dataset as the prompts were made)."""
    config = {"datasets": [{"name": "chain_sum", "weight": 1.0, "config": {"max_terms": 2}},
                           {"name": "basic_arithmetic"}]}
    train, held_out = _splits(_config("composite", size=12, eval_size=4, config=config))
    rows = train + held_out
    assert {json.loads(r["metadata"])["source_dataset"] for r in rows} == {"chain_sum", "basic_arithmetic"}
    columns = _columns(rows)
    assert answer_reward([_written(r["answer"], "tags") for r in rows], **columns) == [1.0] * len(rows)
    assert answer_reward([_written("zq", "tags")] * len(rows), **columns) == [0.0] * len(rows)

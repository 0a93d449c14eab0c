"""The GSM8K reward: the completion's final number against the reference, and chat-wrapped prompts."""

from __future__ import annotations

import pytest

from tasks.core.config import load_config
from tasks.core.data import prompt_of
from tasks.rewards.gsm8k import boxed_format_reward, extract_answer, gsm8k_reward, reference_answer
from tests.conftest import ROOT


@pytest.mark.parametrize("completion,expected", [
    ("3 + 4 = 7, so \\boxed{7}", 7.0),
    ("first \\boxed{5} then corrected: \\boxed{1,234}", 1234.0),
    ("The answer is #### 18", 18.0),
    ("She pays $12.50 in total.", 12.5),
    ("-3 degrees", -3.0),
    ("no number here", None),
])
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_reward_against_gsm8k_references():
    refs = ["Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "#### 1,000", "#### 5"]
    assert reference_answer(refs[0]) == 72 and reference_answer(refs[1]) == 1000
    assert gsm8k_reward(["... \\boxed{72}", "it is 1000.00", "\\boxed{6}"], answer=refs) == [1.0, 1.0, 0.0]
    assert boxed_format_reward(["\\boxed{1}", "\\boxed{1} \\boxed{2}", "1"]) == [1.0, 0.0, 0.0]


def test_system_prompt_wraps_plain_text_prompts():
    cfg = load_config(ROOT / "configs" / "qwen2.5-0.5b-gsm8k.yaml", [])
    msgs = prompt_of(cfg, {"question": "What is 2+2?", "answer": "#### 4"})
    assert msgs[0]["role"] == "system" and "boxed" in msgs[0]["content"]
    assert msgs[1] == {"role": "user", "content": "What is 2+2?"}
    chat = [{"role": "user", "content": "hi"}]
    assert prompt_of(cfg, {"question": chat}) == chat                # already chat: unchanged


def test_the_final_number_is_read_as_written_not_guessed():
    """A box whose content held braces was skipped for the text's last number (`\\boxed{\\frac{1}{2}}` paid 2,
    `\\boxed{\\text{71}} not 72` paid 72; `\\boxed{1{,}000}` read "000"); commas that do not separate thousands
    made a number (`\\boxed{7,2}` paid 72); a tolerance paid 72.0000001; U+2212 and full-width digits were lost;
    a box in the reasoning beat the answer after it."""
    cases = [("\\boxed{\\frac{1}{2}}", "#### 2", 0.0), ("\\boxed{\\text{71}} not 72", "72", 0.0),
             ("\\boxed{1{,}000}", "1000", 1.0), ("\\boxed{\\$1{,}234}", "1234", 1.0), ("\\boxed{7,2}", "72", 0.0),
             ("1,0,0", "100", 0.0), ("\\boxed{72.0000001}", "72", 0.0), ("The answer is \u22125", "-5", 1.0),
             ("\\boxed{\uff14\uff12}", "42", 1.0), ("<think>\\boxed{3}</think> so it is 4", "4", 1.0),
             ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0), ("\\boxed{-\\frac{1}{2}}", "-0.5", 1.0),
             ("answer: 1,000,000", "1000000", 1.0), ("\\boxed{}", "0", 0.0)]
    for completion, ref, want in cases:
        assert gsm8k_reward([completion], answer=[ref]) == [want], completion
    assert boxed_format_reward(["\\boxed{}", "\\boxed{1{,}000}", "\\boxed{\\frac{1}{2}}", "<think>\\boxed{1}</think>"
                                "\\boxed{2}"]) == [0.0, 1.0, 1.0, 1.0]


def test_a_conversation_is_scored_by_its_last_assistant_message():
    """An episode's turns end with what the environment said: a tool's "72" after the model's \\boxed{71} was
    paid; content given as a list of parts was read as its Python repr."""
    from tasks.rewards import text_of
    from tasks.rewards.demo import successor_reward
    from tasks.rewards.math_answer import math_answer_reward

    told = [{"role": "assistant", "content": "\\boxed{71}"}, {"role": "tool", "content": "72"}]
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "so "},
                                               {"type": "text", "text": "\\boxed{72}"}]}]
    assert text_of(told) == "\\boxed{71}" and text_of(parts) == "so \\boxed{72}"
    assert gsm8k_reward([told, parts], answer=["72"] * 2) == [0.0, 1.0]
    assert math_answer_reward([told, parts], answer=["72"] * 2) == [0.0, 1.0]
    assert text_of([{"role": "user", "content": "12"}]) == ""
    assert successor_reward(["", "a"], answer=["", ""]) == [0.0, 0.0]       # (an empty answer divided by zero)


def test_a_number_too_costly_to_compute_is_refused_before_sympy_sees_it():
    """\\boxed{9^{9^{9^{9}}}} ran sympy for minutes off the main thread (no timeout there): the stage hung."""
    import threading

    from tasks.rewards.math_answer import math_answer_reward

    got = []
    worker = threading.Thread(target=lambda: got.append(math_answer_reward(
        ["\\boxed{9^{9^{9^{9}}}}", "x = 2^{100000}", "\\boxed{99999!}", "\\boxed{2^{10}}", "**Answer:** **5**"],
        answer=["3", "3", "1", "1024", "5"])), daemon=True)
    worker.start()
    worker.join(120)                 # (microseconds now; the tower alone never ended before)
    assert got == [[0.0, 0.0, 0.0, 1.0, 1.0]]
    assert math_answer_reward(["<think>\\boxed{3}</think> The answer is \\boxed{4}"], answer=["4"]) == [1.0]


def test_what_the_guards_refuse_is_only_what_they_name():
    """The first guards refused right answers: "**15000**" (bold read as a power), a tower in the working before
    the box, e^{x^2}; NFKC made "36 m²" read 2; a long run of digits, or "^" and spaces, took time quadratic or
    worse in its length (run in a child: the old searches never returned to Python)."""
    import subprocess
    import sys

    from tasks.rewards.math_answer import math_answer_reward

    assert math_answer_reward(["The answer is **15000**.", "Since $2^{2^3}=2^8$ we get \\boxed{256}",
                               "\\boxed{2xe^{x^2}}", "The total is 15000!"],
                              answer=["15000", "256", "2xe^{x^2}", "15000"]) == [1.0, 1.0, 1.0, 1.0]
    assert gsm8k_reward(["The garden's area is 36 m\u00b2."], answer=["#### 36"]) == [1.0]
    probe = ("from tasks.rewards.gsm8k import gsm8k_reward\nfrom tasks.rewards.math_answer import math_answer_reward\n"
             "print(gsm8k_reward(['1' * 200000 + ',1'], answer=['2']), math_answer_reward(['^' + ' ' * 200000 + 'x'],"
             " answer=['1']))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["[0.0]", "[0.0]"], done.stderr[-2000:]


def test_numbers_after_commas_and_boxes_the_second_review_named():
    """The first mend read no number after a comma ("values 3,4,18"), lost the full-width minus, refused
    \\boxed{(x^2)^3} as a tower, and its factorial guard was quadratic in a run of digits (a child: the old one
    never returned to Python)."""
    import subprocess
    import sys

    from tasks.rewards.math_answer import math_answer_reward

    assert [extract_answer(t) for t in ("values 3,4,18", "Therefore,18", "\uff0d\uff15", "1,000")] == \
        [18.0, 18.0, -5.0, 1000.0]
    assert math_answer_reward(["\\boxed{(x^2)^3}"], answer=["x^6"]) == [1.0]
    probe = ("from tasks.rewards.math_answer import math_answer_reward\n"
             "print(math_answer_reward(['\\\\boxed{' + '1' * 300000 + ' x}'], answer=['1']))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.stdout.split() == ["[0.0]"], done.stderr[-2000:]


def test_one_reader_of_message_content_for_rewards_and_judges():
    """Rewards, judges' prompts and judges' answers read a message's content the same way
    (tasks.core.contracts.content_text): the Responses API's `output_text` parts were dropped by the rewards'
    reader (a reply in that form scored 0) and a non-text part that is not a dict was written into a judge's prompt."""
    from tasks.rewards import text_of
    from tasks.rewards.gsm8k import gsm8k_reward
    from tasks.scoring.judge_answers import answer_text
    from tasks.scoring.judges import _text

    reply = [{"role": "assistant", "content": [{"type": "output_text", "text": "so \\boxed{72}"}]}]
    assert text_of(reply) == "so \\boxed{72}"
    assert gsm8k_reward(prompts=[[{"role": "user", "content": "q"}]], completions=[reply],
                        answer=["#### 72"]) == [1.0]
    parts = [{"type": "image_url", "image_url": {"url": "data:,"}}, 7, {"type": "text", "text": "how many?"},
             {"type": "refusal", "refusal": "no"}, {"type": "text", "text": None}]
    assert text_of([{"role": "assistant", "content": parts}]) == "how many?"
    assert _text([{"role": "user", "content": parts}]) == "how many?"
    assert answer_text(parts) == "how many?"

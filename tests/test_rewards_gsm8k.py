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

"""Math rewards for GSM8K-style data: the completion's final number against the reference answer.

The reference is GSM8K's `answer` column (worked solution ending in `#### 72`) or a bare number. The
completion's answer is, in order of preference, the last `\\boxed{...}`, the text after the last `####`, or
the last number in the text. Numbers compare exactly after removing thousands separators, `$` and `%`
(72 == 72.0 == 72.00). Sympy-level equivalence (fractions, expressions) is a job for a math verifier.
"""

from __future__ import annotations

import re

from tasks.rewards import text_of

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def _to_number(text: str) -> float | None:
    text = text.replace(",", "").replace("$", "").replace("%", "").strip().rstrip(".")
    try:
        return float(text)
    except ValueError:
        found = _NUMBER.findall(text)
        return float(found[-1].replace(",", "")) if found else None


def reference_answer(answer: str) -> float | None:
    """`... #### 1,234` -> 1234.0; a bare number is taken as is."""
    return _to_number(answer.split("####")[-1])


def extract_answer(completion: str) -> float | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    if boxed:
        return _to_number(boxed[-1])
    if "####" in completion:
        return _to_number(completion.rsplit("####", 1)[1])
    found = _NUMBER.findall(completion)
    return float(found[-1].replace(",", "")) if found else None


def gsm8k_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference number, else 0.0.

    >>> gsm8k_reward(["so 3+4 = \\\\boxed{7}", "I think 8", "none"], answer=["... #### 7"] * 3)
    [1.0, 0.0, 0.0]
    """
    out = []
    for completion, ref in zip(completions, answer):
        want, got = reference_answer(str(ref)), extract_answer(text_of(completion))
        out.append(1.0 if want is not None and got is not None and abs(want - got) < 1e-6 else 0.0)
    return out


def boxed_format_reward(completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion puts exactly one final answer in \\boxed{...}, else 0.0."""
    return [1.0 if len(re.findall(r"\\boxed\{[^{}]*\}", text_of(c))) == 1 else 0.0 for c in completions]

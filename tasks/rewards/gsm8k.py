"""Math rewards for GSM8K-style data: the completion's final number against the reference answer.

The reference is GSM8K's `answer` column (worked solution ending in `#### 72`) or a bare number. The
completion's answer (after any <think>...</think>) is, in order of preference, the last `\\boxed{...}` (its
braces matched: `\\boxed{\\frac{1}{2}}`, `\\boxed{1{,}000}`), the text after the last `####`, or the last
number in the text. Numbers compare after removing thousands separators (only where they separate thousands:
`7,2` is not 72), `$`, `%` and LaTeX's `\\text{}`, `\\$`, `{,}`; 72 == 72.0 == 72.00, not 72.0000001; a
boxed `\\frac{a}{b}` or `a/b` is its quotient. Sympy-level equivalence is math_answer's (math-verify).
"""

from __future__ import annotations

import math
import re
import unicodedata

from tasks.rewards import after_reasoning, last_boxed, text_of

# (a number starts where no digit or point stands before it, and its digits are taken whole: searching
# from inside a long run of digits took time quadratic in its length)
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|(?>\d+))(?:\.\d+)?(?!,?\d)|(?<![\d.])-?\.\d+")
_FRACTION = re.compile(r"^(-?)\\[dt]?frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$|^(-?[\d.]+)\s*/\s*(-?[\d.]+)$")
_LATEX = re.compile(r"\\text\{([^{}]*)\}|\\mathrm\{([^{}]*)\}|\{,\}|\\[$%,!; ]")


def _plain(text: str) -> str:
    """Decimal digits of any script as ASCII (full-width ４２; not a superscript: m² is not m2), U+2212 and
    U+FF0D as "-", LaTeX's wrappers of a number dropped."""
    if not text.isascii():
        text = "".join(str(unicodedata.decimal(c)) if c.isdecimal() and not c.isascii() else c
                       for c in text).replace("\u2212", "-").replace("\uff0d", "-")
    return _LATEX.sub(lambda m: m.group(1) or m.group(2) or ("," if m.group(0) == "{,}" else ""), text)


def _to_number(text: str) -> float | None:
    text = _plain(text).replace("$", "").replace("%", "").strip().rstrip(".").strip()
    if (frac := _FRACTION.match(text)) is not None:
        sign, a, b = (frac.group(1), frac.group(2), frac.group(3)) if frac.group(2) else ("", *frac.group(4, 5))
        try:
            value = float(a) / float(b)
        except (ValueError, ZeroDivisionError):
            return None
        return -value if sign else value
    return _last_number(text)


def _last_number(text: str) -> float | None:
    """The last number in `text` (already _plain), its thousands separators taken off."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def reference_answer(answer: str) -> float | None:
    """`... #### 1,234` -> 1234.0; a bare number is taken as is."""
    return _to_number(answer.split("####")[-1])


def extract_answer(completion: str) -> float | None:
    completion = after_reasoning(completion)
    boxed = last_boxed(completion)
    if boxed is not None:
        return _to_number(boxed)
    if "####" in completion:
        return _to_number(completion.rsplit("####", 1)[1])
    return _last_number(_plain(completion))


def gsm8k_reward(completions: list[str], answer: list[str], **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference number, else 0.0.

    >>> gsm8k_reward(["so 3+4 = \\\\boxed{7}", "I think 8", "none"], answer=["... #### 7"] * 3)
    [1.0, 0.0, 0.0]
    """
    out = []
    for completion, ref in zip(completions, answer):
        want, got = reference_answer(str(ref)), extract_answer(text_of(completion))
        out.append(1.0 if want is not None and got is not None and math.isclose(want, got, rel_tol=1e-12,
                                                                                 abs_tol=1e-12) else 0.0)
    return out


def boxed_format_reward(completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion (after any reasoning) puts exactly one final answer, a number, in \\boxed{...}."""
    out = []
    for c in completions:
        text = after_reasoning(text_of(c))
        boxed = last_boxed(text)
        out.append(1.0 if text.count("\\boxed{") == 1 and boxed is not None and _to_number(boxed) is not None
                   else 0.0)
    return out

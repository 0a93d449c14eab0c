"""Math answers checked by `math-verify`: the completion's final answer against the reference, symbolically.

    reward.functions: [{fn: "tasks.rewards.math_answer:math_answer_reward"}]

`math-verify` (Hugging Face's verifier, used by open-r1) extracts the answer, after any <think>...</think>, from
LaTeX (`\\boxed{}` first) or a plain expression and compares it with sympy: `\\frac{1}{2}`, `0.5` and `1/2` are
equal, so are `\\sqrt{8}` and `2\\sqrt{2}`, sets and intervals compare as such. The reference is the row's
`answer` (a bare answer, or GSM8K's worked solution ending in `#### 72`) or `solution` (MATH-style text with a
`\\boxed{}`).

Each parse and each comparison has its own timeout (`timeout_seconds`, signal-based, so it needs the main
thread: the reward worker calls functions there; from another thread it runs without one, and the stage's
per-function timeout still applies). A reference that cannot be parsed scores None (not applicable).
"""

from __future__ import annotations

import re
import threading

from tasks.rewards import after_reasoning, last_boxed, text_of

# A tower of numbers (9^{9^{9^9}}), an exponent of five digits or more (2^{100000}, 2**100000), or in a \boxed{} a
# factorial of such a number: sympy would compute it, for minutes, without a timeout off the main thread. The
# final answer is checked (the last box where there is one: the working may hold 2^{2^3}); such a reply scores 0.
_TOO_COSTLY = re.compile(r"\^[\s{(+-]{0,8}\d{5,}|[\w)]\*\*[\s(+-]{0,8}\d{5,}"           # a long exponent
                         r"|\^[\s{(]{0,8}(?<!\d)\d++\s{0,8}\^")                           # a tower of numbers
_FACTORIAL = re.compile(r"(?<!\d)\d{5,}+\s{0,8}!")


def _reference_text(answer, solution) -> str | None:
    if answer is not None and str(answer).strip():
        text = str(answer)
        return text.split("####")[-1].strip() if "####" in text else text.strip()
    if solution is not None and str(solution).strip():
        return str(solution)
    return None


def math_answer_reward(completions: list[str], answer: list | None = None, solution: list | None = None,
                       timeout_seconds: int = 5, **kwargs) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference mathematically, 0.0 when not, None when
    the reference has no parsable answer.

    >>> math_answer_reward(["so it is \\\\boxed{\\\\frac{1}{2}}", "\\\\boxed{0.5}", "maybe 3"], answer=["0.5"] * 3)
    [1.0, 1.0, 0.0]
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    n = len(completions)
    answers = answer if answer is not None else [None] * n
    solutions = solution if solution is not None else [None] * n
    timeout = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    extraction = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    out: list[float | None] = []
    for completion, ans, sol in zip(completions, answers, solutions):
        ref = _reference_text(ans, sol)
        gold = parse(ref if "\\boxed" in ref or "$" in ref else f"${ref}$", parsing_timeout=timeout) if ref else []
        if not gold:
            out.append(None)
            continue
        said = after_reasoning(text_of(completion))
        boxed = last_boxed(said)
        if _TOO_COSTLY.search(said if boxed is None else boxed) or (boxed and _FACTORIAL.search(boxed)):
            out.append(0.0)
            continue
        pred = parse(said, extraction_config=extraction, parsing_timeout=timeout)
        out.append(1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0)
    return out

"""A reward model's answer read as scores (reward.models; docs/reward-models.md): a classifier's label, a verdict's
probability, a judge's answer through its parser (the built-in 'number', 'choice' and 'scores', or the user's).
Whatever the server sent, a malformed, non-finite or huge value is `Unparsed` (that completion's missing score,
counted), never a traceback. Used by tasks/scoring/judges.py, which asks and caches.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any

from tasks.core.contracts import content_text

if TYPE_CHECKING:
    from tasks.core.config import RewardModel

LARGEST = 3.4e38                       # as a function's score (tasks/scoring/functions.py: float32's range)
BUILTIN = {"pointwise": "number", "pairwise": "choice", "group": "scores"}     # parser: auto, by mode
MAX_TEXT = 64 * 1024                   # characters of an answer kept (a URL server may ignore max_tokens)

_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
# a number, "N/10" and "N out of 10" read as N (the denominator is the scale, not the score)
# (every pattern matches in linear time: one possessive `\s*+` between tokens, never two stacked around an optional
# part, which backtracked polynomially: "score" + 400 spaces took half a minute, and an answer may be 64 KiB)
_NUMBER = re.compile(rf"({_NUM})(?:\s*+(?:/|out\s++of)\s*+{_NUM})?")
# "Score: 3 (2 mistakes)": a labelled number wins over the numbers of the reasoning after it
_LABELLED = re.compile(rf"\b(?:score|rating|grade)\b\s*+(?:(?:is|of)\b\s*+)?(?:[:=]\s*+)?(?:[*_\"'`]++\s*+)?({_NUM})",
                       re.IGNORECASE)
# pairwise: a final-choice form (MT-Bench's [[A]], [[C]] a tie; "Answer: A", "Winner is B", "Verdict = A": a ':',
# '=' or 'is' after the keyword, so a template's "Answer A" / "Answer B" labels are no verdict; "A is better")
_BRACKETED = re.compile(r"\[\[\s*+(A|B|C|tie)\s*+\]\]", re.IGNORECASE)
# (markdown around the keyword counts as nothing: "**Final Verdict**: B", "The better response: **B**")
_CHOSEN = re.compile(r"(?i:\b(?:final\s++)?(?:answer|winner|verdict|choice|decision|preferred|better"
                     r"(?:\s++(?:one|response|answer|completion))?)\b)[*_]*+"
                     r"\s*+(?i:is\b\s*+[:=]?|[:=])\s*+(?:[*_\"'`(\[]++\s*+)?"
                     r"(?i:(?:response|answer|assistant|completion)\s++)?(A|B|(?i:tie))\b")
_WINS = re.compile(r"\b(A|B)\b\s++(?i:is\s++(?:(?:clearly|much)\s++)?(?:better|superior|preferred|the\s++better)"
                   r"|wins)\b")
_LETTER = re.compile(r"\b(A|B)\b")               # capitals only: the article "a" is no vote
_TIE = re.compile(r"\btie\b", re.IGNORECASE)
# (a line's indent never spans a newline: `^\s*` ran from every line of a run of blank lines to its end, quadratic)
_LINE = re.compile(r"^[^\S\n]*+\[?(\d++)\]?\s*+[:.)=-]\s*+(-?\d++(?:\.\d+)?)", re.MULTILINE)


class Unparsed(ValueError):
    """An answer that gives no score (the completion's score is missing, counted)."""


def answer_text(content: Any) -> str:
    """A message's content as text: a string, or the text of its parts (OpenAI's [{"type": "text", "text": ...}]),
    at most MAX_TEXT characters (its head and its end: the final line a score is read from)."""
    text = content_text(content)
    if len(text) > MAX_TEXT:              # (at most MAX_TEXT after: a stored answer is not cut again)
        half = (MAX_TEXT - 3) // 2
        text = text[:half] + "\n…\n" + text[-half:]
    return text


def scores_of(spec: RewardModel, n: int, answer: Any, parser=None) -> list[float]:
    """The scores `answer` gives the `n` completions it was asked about (pairwise: the winner's 1, the loser's 0,
    a tie's 0.5 each); Unparsed if it gives none, or a value that is not finite or beyond ±LARGEST."""
    if not isinstance(answer, dict):
        raise Unparsed(f"a malformed answer {str(answer)[:80]!r}")
    try:
        values = _scores(spec, n, answer, parser)
    except Unparsed:
        raise
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError, RecursionError,
            MemoryError) as e:
        raise Unparsed(f"a malformed answer ({type(e).__name__}: {str(e)[:80]})") from None
    if not all(math.isfinite(v) and abs(v) <= LARGEST for v in values):
        raise Unparsed(f"not finite or beyond ±{LARGEST:g}: {values}")
    return values


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Unparsed(f"not a number: {v!r}")
    return float(v)


def _scores(spec: RewardModel, n: int, answer: dict, parser) -> list[float]:
    if spec.kind == "classifier":
        values = answer.get("logits" if spec.score == "logit" else "probs")
        if values is None:
            raise Unparsed(f"the server gave no {spec.score}s (score: probability reads vLLM's /classify)")
        if not isinstance(values, list):
            raise Unparsed(f"{spec.score}s {str(values)[:80]!r}: expected a list")
        if spec.label >= len(values):
            raise Unparsed(f"label {spec.label} of a classifier with {len(values)} outputs")
        return [_number(values[spec.label])]
    text = answer_text(answer.get("text"))
    if spec.kind == "verdict":
        top = answer.get("top") or {}
        for lp in top.values():          # (a log-probability is at most 0: NaN, +inf or 1000 is no answer)
            if math.isnan(_number(lp)) or lp > 1e-6:
                raise Unparsed(f"not a log-probability: {lp!r}")
        good, bad = (sum(math.exp(min(lp, 0.0)) for t, lp in top.items() if str(t).strip() == v.strip())
                     for v in spec.verdict_tokens)
        if good + bad == 0:
            raise Unparsed(f"neither {spec.verdict_tokens[0]!r} nor {spec.verdict_tokens[1]!r} among the answer's "
                           f"{len(top)} likeliest first tokens")
        return [good / (good + bad)]
    if parser is not None:
        try:
            got = parser(text, n)
        except Exception as e:  # noqa: BLE001 - the user's parser: its failure is this answer's
            raise Unparsed(f"parser {spec.parser} raised {type(e).__name__}: {e}") from None
    elif spec.mode == "pointwise":
        got = _pointwise(text)
    elif spec.mode == "pairwise":
        got = _choice(text)
    else:
        got = _group_scores(text, n)
    if spec.mode == "pairwise":
        choice = str(got).strip().lower()
        if choice not in ("a", "b", "tie"):
            raise Unparsed(f"parser gave {got!r}, expected 'A', 'B' or 'tie'")
        return {"a": [1.0, 0.0], "b": [0.0, 1.0], "tie": [0.5, 0.5]}[choice]
    values = [got] if spec.mode == "pointwise" else list(got) if isinstance(got, (list, tuple)) else None
    if values is None or len(values) != n:
        raise Unparsed(f"expected {n} score{'s' if n > 1 else ''}, got {got!r}")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError):
        raise Unparsed(f"not numbers: {got!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise Unparsed(f"not finite: {values}")
    if spec.scale is not None:
        lo, hi = spec.scale
        if not all(lo <= v <= hi for v in values):
            raise Unparsed(f"{values} outside the scale [{lo:g}, {hi:g}]")
        values = [(v - lo) / (hi - lo) if hi > lo else 0.0 for v in values]
    return values


def _pointwise(text: str) -> float:
    """The last labelled number ("Score: 7"), else the last number; "8/10" and "8 out of 10" read as 8."""
    found = _LABELLED.findall(text) or _NUMBER.findall(text)
    if not found:
        raise Unparsed(f"no number in the answer {text[:80]!r}")
    return float(found[-1])


def _choice(text: str) -> str:
    """'A', 'B' or 'tie': the last final-choice form ([[A]], "Answer: A", "A is better"), else the one letter
    named (an answer naming both without saying which won gives none: "Answer A is more detailed" is no verdict,
    a template's label)."""
    for form in (_BRACKETED, _CHOSEN, _WINS):
        if found := form.findall(text):
            return "tie" if found[-1].upper() in ("C", "TIE") else found[-1].upper()
    bare = text.strip().strip(".*_\"'`[]()").strip()
    if bare.lower() in ("a", "b", "tie"):
        return bare
    named = set(_LETTER.findall(text)) | ({"tie"} if _TIE.search(text) else set())
    if len(named) != 1:
        raise Unparsed(f"{'no' if not named else 'no single'} A, B or tie in the answer {text[:80]!r}")
    return named.pop()


def _group_scores(text: str, n: int) -> list[float]:
    """The last JSON list of n numbers (or {"scores": [...]}), scanned from the right (a RULER answer cites "[1]"
    before its list), else lines 'k: x' for exactly k = 1..n."""
    decoder = json.JSONDecoder()
    for at in sorted((i for i, c in enumerate(text) if c in "[{"), reverse=True):
        try:
            got, _ = decoder.raw_decode(text, at)
        except ValueError:
            continue
        except (RecursionError, MemoryError):     # ("[" * 5000: nested past the interpreter's limit)
            raise Unparsed(f"a JSON value nested too deep in the answer {text[:80]!r}") from None
        if isinstance(got, dict):
            got = got.get("scores")
        if isinstance(got, list) and len(got) == n and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                           for v in got):
            return got
    pairs = [(int(k), float(v)) for k, v in _LINE.findall(text)]
    keys = [k for k, _ in pairs]
    if sorted(keys) == list(range(1, n + 1)):        # (a repeated, missing or extra index: no reading)
        lines = dict(pairs)
        return [lines[k] for k in range(1, n + 1)]
    raise Unparsed(f"no list of {n} scores in the answer {text[:80]!r}")

"""Rewards for reasoning-gym tasks (data.reasoning_gym, tasks/core/procedural.py): the task's own checker, and
whether the answer came in the form the prompt asked for.

    reward.functions: [{fn: "tasks.rewards.reasoning_gym:answer_reward", weight: 1.0},
                       {fn: "tasks.rewards.reasoning_gym:format_reward", weight: 0.2}]

Both have TRL's signature and read the dataset columns the data source writes (`answer`, `question`,
`metadata`, `answer_format`, `reasoning_gym`), so they also work in TRL's GRPOTrainer on the same rows.
`answer_reward` reads the answer the way the row's `answer_format` asks for it (`tags`: the last
<answer>...</answer>, reasoning-gym's own `extract_answer`; `answer_is`: the text after the last "answer is";
`final`: leniently, see `readings`) and pays 1.0 when the task's own `score_answer` says it is right, else 0.0:
correctness, not the checkers' partial credit, which pays a wrong number that holds the right one ("13" or "-3"
for 3: 0.5; `partial_credit=True` keeps it). `format_reward` is 1.0 when the reply ends with its answer in
that form, exactly once (`final`: the reply is one line).
More: docs/internals.md (tasks/rewards/reasoning_gym.py): why `final`.
"""

from __future__ import annotations

import functools
import json
import re

from tasks.core.procedural import untagged
from tasks.rewards import text_of

_TAGS = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
# (the text up to the line's end or the next "answer is": a reply that says it twice on one line is read at the last)
_ANSWER_IS = re.compile(r"answer is\s*:?\s*((?:(?!answer is)[^\n])*)", re.IGNORECASE)
# "... the answer is X." as the reply's last sentence, its full stop included (a reply cut off mid-answer has none):
# X holds no sentence break (". " and the like) before the end
_ENDS_WITH_ANSWER_IS = re.compile(r"(?:^|[\s.!?:])the answer is\s*:?\s*(?:(?![.!?]\s)[^\n])*[^\s.]\.\s*$",
                                  re.IGNORECASE)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_ONE_NUMBER = re.compile(r"\s*-?\d+(?:\.\d+)?\s*")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")        # 1,000 is one number


def _tagged(text: str) -> list[str]:
    """_TAGS.findall, on the text up to its last </answer> (an <answer> after it is never closed: searching on
    from each of many such took time quadratic in the reply's length)."""
    end = text.rfind("</answer>")
    return _TAGS.findall(text[:end + len("</answer>")]) if end >= 0 else []


def read_answer(text: str, answer_format: str) -> str | None:
    """The answer in a reply, read the way `answer_format` asks for it; None when there is none."""
    if answer_format == "tags":
        found = _tagged(text)
        return found[-1].strip() if found else None
    found = _ANSWER_IS.findall(text)
    if found:
        return _clean(found[-1]) or None
    if answer_format == "final":
        if tagged := _tagged(text):
            return tagged[-1].strip() or None
        lines = [line for line in text.splitlines() if line.strip()]
        return _clean(_AFTER.split(lines[-1])[-1]) or None if lines else None
    return None


# final: the right side of a last line's last "=" or ": " ("5 + 7 = 12", "The words are: and"; not "05:44")
_AFTER = re.compile(r"=|:\s")


def _clean(answer: str) -> str:
    return answer.strip().strip("*`\"' ").rstrip(".").strip("*`\"' ")


def readings(text: str, answer_format: str, answer: str | None = None) -> list[str]:
    """What answer_reward scores (the best counts): the answer read_answer finds; with answer_is and final also
    it with a full stop (the sentence's stop cannot be told from an answer's own) and the text it was read from as
    written (an answer's own quotes: `"Now go," he said.`); under final, where the row's `answer` itself holds
    "=" or ": " (`A=7,G=0`, `{"root": 2.5}`), a quote or its own full stop, also the whole last line (not for
    other answers: a checker that reads a line's first number would pay "12 + 5 = 17" for 12); with final also the
    last number in it ("... appears 2 times" -> "2"; the last one only, so listing numbers gains nothing). Where
    the row's answer is one number and the reading holds several ("21 or 20"), only its last number (answer_is,
    final: gsm_symbolic's checker reads the first, so every reading would be a second guess)."""
    read = read_answer(text, answer_format)
    if read is None:
        return []
    if answer_format == "tags":
        return [read]
    numbers = _NUMBER.findall(_THOUSANDS.sub("", read))
    if len(numbers) > 1 and answer is not None and _ONE_NUMBER.fullmatch(str(answer)):
        return [numbers[-1]]          # (a checker reading the first number would pay "21 or 20" and "20 or 21")
    found = [read, read + "."]
    if (raw := _as_written(text, answer_format, _cut_by_reading(answer))) is not None:
        found += [raw, raw.removesuffix(".")]
    found += [numbers[-1]] if numbers and answer_format == "final" else []
    return [r for r in dict.fromkeys(found) if r]


def _cut_by_reading(answer: str | None) -> bool:
    """Whether reading a last line leniently would cut such an answer ("=", ": ", quotes, a full stop)."""
    answer = str(answer).strip() if answer is not None else ""
    return "=" in answer or ": " in answer or answer[:1] in ("'", '"') or answer.endswith(".")


def _as_written(text: str, answer_format: str, whole_line: bool = False) -> str | None:
    """The text read_answer reads its answer from, only stripped of the spaces around it: what follows the last
    "answer is", or (final, without one, nor tags, where `whole_line`) the last line."""
    if found := _ANSWER_IS.findall(text):
        return found[-1].strip()
    if answer_format == "final" and whole_line and not _tagged(text):
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else None
    return None


@functools.lru_cache(maxsize=16)
def _task(spec: str):
    """The task's dataset object (for its score_answer), from the row's `reasoning_gym` column (made as the
    prompts were: tasks/core/procedural.py)."""
    from tasks.core.procedural import create

    parsed = json.loads(spec)
    return create(parsed["task"], parsed["config"], seed=0, size=1)


def answer_reward(completions: list, answer: list[str], question: list[str], metadata: list[str],
                  reasoning_gym: list[str], answer_format: list[str], partial_credit: bool = False,
                  **kwargs) -> list[float]:
    """1.0 where the task's own `score_answer` finds the answer read from the completion right, else 0.0 (none
    read: 0.0). reasoning-gym's default checker, and chain_sum's or products', pays len(right) / len(read) for
    a wrong answer that contains the right one as text: 0.5 for "13" or "-3" when the sum is 3, measured paying
    SmolLM2 for wrong sums of one digit. `partial_credit=True` (reward.functions[].kwargs) pays the checker's
    score as it is.

    >>> rows = dict(answer=["12"], question=["Calculate 7 + 5."], metadata=['{}'], answer_format=["answer_is"],
    ...             reasoning_gym=['{"config": {}, "task": "basic_arithmetic"}'])
    >>> answer_reward(["7 + 5 = 12. The answer is 12."], **rows), answer_reward(["The answer is 13."], **rows)
    ([1.0], [0.0])
    >>> rows = dict(rows, answer=["3"], question=["6 + 4 - 7 ="])
    >>> answer_reward(["The answer is 13."], **rows), answer_reward(["The answer is 13."], partial_credit=True, **rows)
    ([0.0], [0.5])
    """
    out = []
    for completion, ans, q, meta, spec, fmt in zip(completions, answer, question, metadata, reasoning_gym,
                                                   answer_format):
        found = readings(text_of(completion), fmt, ans)
        if not found:
            out.append(0.0)
            continue
        entry = {"question": q, "answer": ans, "metadata": untagged(json.loads(meta))}
        scores = []
        for reading in found:
            try:
                scores.append(float(_task(spec).score_answer(reading, entry)))
            except Exception:  # noqa: BLE001 - a checker choking on what the model wrote: a wrong answer
                scores.append(0.0)
        best = max(scores)
        out.append(best if partial_credit else float(best >= 1.0))
    return out


FINAL_WORDS = 4          # final: an answer read from the form has at most this many words ("federal, ambassador")


def format_reward(completions: list, answer_format: list[str], answer: list | None = None, **kwargs) -> list[float]:
    """1.0 when the reply gives its answer exactly once, in the asked form, at its end (answer_is: the sentence
    with its full stop, so a reply cut off by the length limit does not count; final: one line whose answer,
    after a last "answer is", "=" or ": ", else the whole line, is at most FINAL_WORDS words, or as many as the
    row's `answer` has where it has more (a sentence, a list of moves): a longer sentence with a number in it is
    not in form, a short one such as "The sum is 17" is); else 0.0.

    >>> format_reward(["<answer>12</answer>", "<answer>1</answer><answer>2</answer>"], answer_format=["tags"] * 2)
    [1.0, 0.0]
    >>> format_reward(["7 + 5 = 12. The answer is 12.", "The answer is 12. Also..."], answer_format=["answer_is"] * 2)
    [1.0, 0.0]
    """
    out, answers = [], answer if answer is not None else [None] * len(completions)
    for completion, fmt, ans in zip(completions, answer_format, answers):
        text = text_of(completion).strip()
        if fmt == "tags":
            found = _tagged(text)
            ok = len(found) == 1 and found[0].strip() != "" and text.endswith("</answer>") \
                and text.count("<answer>") == 1                # (not <answer><answer>12</answer></answer>)
        elif fmt == "final":               # one line, its answer where the form puts it, alone (<= 4 words)
            read = read_answer(text, fmt)
            words = max(FINAL_WORDS, len(str(ans).split()) if ans is not None else 0)
            ok = "\n" not in text and read is not None and len(read.split()) <= words
        else:
            ok = len(_ANSWER_IS.findall(text)) == 1 and _ENDS_WITH_ANSWER_IS.search(text) is not None
        out.append(1.0 if ok else 0.0)
    return out

"""Rewards for reasoning-gym tasks (data.reasoning_gym, tasks/core/procedural.py): the task's own checker, and
whether the answer came in the form the prompt asked for.

    reward:
      functions:
        - {fn: "tasks.rewards.reasoning_gym:answer_reward", weight: 1.0}
        - {fn: "tasks.rewards.reasoning_gym:format_reward", weight: 0.2}

Both have TRL's signature and read the dataset columns the data source writes (`answer`, `question`,
`metadata`, `answer_format`, `reasoning_gym`), so they also work in TRL's GRPOTrainer on the same rows.
`answer_reward` reads the answer the way the row's `answer_format` asks for it (`tags`: the last
<answer>...</answer>, reasoning-gym's own `extract_answer`; `answer_is`: the text after the last "answer is")
and scores it with the task's own `score_answer` (1.0 right; some tasks give partial credit; 0.0 when no
answer can be read). `format_reward` is 1.0 when the reply ends with its answer in that form, exactly once.
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


def read_answer(text: str, answer_format: str) -> str | None:
    """The answer in a reply, read the way `answer_format` asks for it; None when there is none."""
    if answer_format == "tags":
        found = _TAGS.findall(text)
        return found[-1].strip() if found else None
    found = _ANSWER_IS.findall(text)
    if not found:
        return None
    answer = found[-1].strip().strip("*`\"' ").rstrip(".").strip("*`\"' ")
    return answer or None


@functools.lru_cache(maxsize=16)
def _task(spec: str):
    """The task's dataset object (for its score_answer), from the row's `reasoning_gym` column."""
    import reasoning_gym

    parsed = json.loads(spec)
    return reasoning_gym.create_dataset(parsed["task"], **parsed["config"], seed=0, size=1)


def answer_reward(completions: list, answer: list[str], question: list[str], metadata: list[str],
                  reasoning_gym: list[str], answer_format: list[str], **kwargs) -> list[float]:
    """The task's own `score_answer` of the answer read from each completion (0.0 when none can be read).

    >>> rows = dict(answer=["12"], question=["Calculate 7 + 5."], metadata=['{}'], answer_format=["answer_is"],
    ...             reasoning_gym=['{"config": {}, "task": "basic_arithmetic"}'])
    >>> answer_reward(["7 + 5 = 12. The answer is 12."], **rows), answer_reward(["The answer is 13."], **rows)
    ([1.0], [0.0])
    """
    out = []
    for completion, ans, q, meta, spec, fmt in zip(completions, answer, question, metadata, reasoning_gym,
                                                   answer_format):
        read = read_answer(text_of(completion), fmt)
        if read is None:
            out.append(0.0)
            continue
        entry = {"question": q, "answer": ans, "metadata": untagged(json.loads(meta))}
        # "The answer is X." cannot tell whether X's own sentence ends in that full stop (a sentence answer):
        # both readings are scored, the better counts
        readings = [read, read + "."] if fmt == "answer_is" else [read]
        scores = []
        for reading in readings:
            try:
                scores.append(float(_task(spec).score_answer(reading, entry)))
            except Exception:  # noqa: BLE001 - a checker choking on what the model wrote: a wrong answer
                scores.append(0.0)
        out.append(max(scores))
    return out


def format_reward(completions: list, answer_format: list[str], **kwargs) -> list[float]:
    """1.0 when the reply gives its answer exactly once, in the asked form, at its end (answer_is: the sentence
    with its full stop, so a reply cut off by the length limit does not count); else 0.0.

    >>> format_reward(["<answer>12</answer>", "<answer>1</answer><answer>2</answer>"], answer_format=["tags"] * 2)
    [1.0, 0.0]
    >>> format_reward(["7 + 5 = 12. The answer is 12.", "The answer is 12. Also..."], answer_format=["answer_is"] * 2)
    [1.0, 0.0]
    """
    out = []
    for completion, fmt in zip(completions, answer_format):
        text = text_of(completion).strip()
        if fmt == "tags":
            found = _TAGS.findall(text)
            ok = len(found) == 1 and found[0].strip() != "" and text.endswith("</answer>")
        else:
            ok = len(_ANSWER_IS.findall(text)) == 1 and _ENDS_WITH_ANSWER_IS.search(text) is not None
        out.append(1.0 if ok else 0.0)
    return out

"""Reward functions shipped with rlflow. Each is called as TRL calls reward functions (every argument by keyword;
for chat prompts each completion is [{"role": "assistant", "content": ...}]) and returns list[float | None]."""

from tasks.core.contracts import content_text


def text_of(completion) -> str:
    """A completion as text: a string as it is; a (TRL conversational) list of messages as its last assistant
    message's content (an episode's turns end with what the environment said: that is not the model's answer),
    its text parts joined where the content is a list of parts (tasks.core.contracts.content_text)."""
    if isinstance(completion, list):
        said = [m for m in completion if isinstance(m, dict) and m.get("role", "assistant") == "assistant"]
        return content_text(said[-1].get("content")) if said else ""
    return completion if isinstance(completion, str) else str(completion or "")


def after_reasoning(text: str) -> str:
    """What a reply says after its reasoning: after the last </think>; a reply whose <think> is never closed has
    no answer yet (what stands before it is kept)."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    return text.split("<think>", 1)[0]


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, its braces matched (None when there is none or it is not closed)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None

"""Reward functions shipped with rlflow. Each is called as TRL calls reward functions (every argument by keyword;
for chat prompts each completion is [{"role": "assistant", "content": ...}]) and returns list[float | None]."""


def text_of(completion) -> str:
    """A completion as text: a string as it is, a (TRL conversational) list of messages as the last one's content."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    return completion if isinstance(completion, str) else str(completion or "")

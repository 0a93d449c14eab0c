"""Chat messages to token ids, as the policy's chat template renders them: a prompt, and what follows a model turn
(the turn's closing, new messages, the next turn's header) rendered alone, so it can be appended to the tokens
sampled so far. The episode loop (episodes.py) appends environments' observations with it; the agents' endpoint
(endpoint.py) continues a conversation on an earlier call's tokens with it; the warm start (tasks/sft.py) renders
a whole demonstration with it (`conversation`), so its tokens and masks are the ones an episode would have.
"""

from __future__ import annotations

from tasks.core.data import cut_prompt
from tasks.core.models import parts_as_text


def chat_text(tok, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
    """The chat template's text of `messages` (content as parts: their text, to a text model's template)."""
    return tok.apply_chat_template(parts_as_text(tok, messages), tools=tools or None,
                                   add_generation_prompt=generation, tokenize=False)


class Renderer:
    """Token ids of prompts and observations as the tokenizer's chat template renders them."""

    DUMMY = "rlflow-dummy-turn"
    TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": DUMMY}]

    def __init__(self, tokenizer, max_prompt_length: int):
        self.tok, self.max_prompt_length = tokenizer, max_prompt_length
        self.eos_text = tokenizer.eos_token or ""
        self._heads: dict[str, tuple[str, str]] = {}

    def template(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        return chat_text(self.tok, messages, tools, generation)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        text = self.template(messages, tools, True)
        return cut_prompt(self.tok(text, add_special_tokens=False)["input_ids"], self.max_prompt_length)

    def conversation(self, prompt: list[dict], rest: list[dict], tools: list[dict] | None,
                     turn_limit: int | None = None) -> tuple[list[int], list[int]]:
        """A whole conversation's token ids and mask, as an episode of the same turns would hold them: `prompt` as
        prompt() renders it (mask 0), then each assistant message of `rest` as the model writes it (its text, then
        EOS: mask 1) and the messages after it as observation() renders them (mask 0). `turn_limit`: the most
        tokens a model turn has (generate.max_completion_length): a text of exactly that many is cut there, EOS
        unwritten, as the episode loop cuts it; a longer one is refused. `rest` ends with an assistant message; its
        first is one. ValueError (what is wrong, without where) otherwise."""
        if not rest or rest[0].get("role") != "assistant" or rest[-1].get("role") != "assistant":
            raise ValueError("the demonstration's turns after the prompt must start and end with an assistant "
                             "message")
        ids = self.prompt(prompt, tools)
        mask = [0] * len(ids)
        eos = self.tok.eos_token_id
        i = 0
        while i < len(rest):
            turn = self.tok(self.assistant_text(rest[i], tools), add_special_tokens=False)["input_ids"]
            if turn_limit is not None and len(turn) > turn_limit:
                raise ValueError(f"assistant turn {sum(m.get('role') == 'assistant' for m in rest[:i]) + 1}: "
                                 f"{len(turn)} tokens, above generate.max_completion_length {turn_limit}, the most "
                                 f"a model turn of an episode has")
            ended = eos is not None and (turn_limit is None or len(turn) < turn_limit)
            turn += [eos] if ended else []
            ids, mask = ids + turn, mask + [1] * len(turn)
            j = i + 1
            while j < len(rest) and rest[j].get("role") != "assistant":
                j += 1
            if j < len(rest):
                if j == i + 1:
                    raise ValueError(f"two assistant messages in a row (turns {i + 1} and {j + 1} after the "
                                     f"prompt): the template needs another role between them")
                obs = self.observation(rest[i + 1:j], tools, ended_with_eos=ended)
                ids, mask = ids + obs, mask + [0] * len(obs)
            i = j
        return ids, mask

    def assistant_text(self, message: dict, tools: list[dict] | None) -> str:
        """What the model writes for an assistant message: its content, or where it has structured tool_calls
        (OpenAI's and TRL's form) the text the chat template renders for them (Hermes' <tool_call> tags...)."""
        content = message.get("content") or ""
        if isinstance(content, list):      # (content parts: their text)
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not message.get("tool_calls"):
            return content
        head = self.template(self.TURN[:1], tools, True)
        full = self.template([*self.TURN[:1], message], tools, False)
        closing = self._closing(tools)
        if not full.startswith(head) or not full.endswith(closing):
            raise ValueError("the chat template renders an assistant message with tool_calls around other text "
                             "than a plain one's; write the calls in its content as the model would")
        return full[len(head):len(full) - len(closing)] if closing else full[len(head):]

    def _closing(self, tools: list[dict] | None) -> str:
        """What the template writes after an assistant message's content (its end of turn, EOS included)."""
        key = repr(tools)
        if key not in self._heads:
            prefix = self.template(self.TURN, tools, False)
            if self.DUMMY not in prefix:
                raise ValueError("the chat template does not render an assistant message's content")
            self._heads[key] = (prefix, prefix[prefix.rindex(self.DUMMY) + len(self.DUMMY):])
        return self._heads[key][1]

    def observation(self, messages: list[dict], tools: list[dict] | None, ended_with_eos: bool) -> list[int]:
        """The end of the assistant's turn (less the EOS it wrote), the observation, the next turn's header."""
        closing = self._closing(tools)
        prefix = self._heads[repr(tools)][0]
        full = self.template(self.TURN + messages, tools, True)
        if not full.startswith(prefix):
            raise ValueError("the chat template renders earlier turns differently once more follow; the "
                             "observation's tokens cannot be appended")
        if ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self.tok(closing + full[len(prefix):], add_special_tokens=False)["input_ids"]


def turn_fault(messages: list[dict]) -> str | None:
    """Where a conversation's turns cannot be an episode's, or None: two assistant messages in a row (the model
    takes one turn at a time), or a tool result that follows no assistant message. Several user (or tool)
    messages in a row are an environment's observation as the episode loop keeps it (a reset or a step may
    answer with several), so they stay; a chat template that refuses them says so itself."""
    for j, m in enumerate(messages):
        before = messages[j - 1]["role"] if j else None
        if m["role"] == "tool" and before not in ("assistant", "tool"):
            return (f"message {j} (role tool) answers no tool call: it follows "
                    + (f"a {before} message" if before else "nothing")
                    + "; a tool result follows the assistant message that called the tool")
        if m["role"] == "assistant" and before == "assistant":
            return (f"two assistant messages in a row (messages {j - 1} and {j}); the model takes one turn at a "
                    f"time: join them into one, or put the observation between them")
    return None

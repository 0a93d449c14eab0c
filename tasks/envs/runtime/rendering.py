"""Chat messages to token ids, as the policy's chat template renders them: a prompt, and what follows a model turn
(the turn's closing, new messages, the next turn's header) rendered alone, so it can be appended to the tokens
sampled so far. The episode loop (episodes.py) appends environments' observations with it; the agents' endpoint
(endpoint.py) continues a conversation on an earlier call's tokens with it.
"""

from __future__ import annotations


class Renderer:
    """Token ids of prompts and observations as the tokenizer's chat template renders them."""

    DUMMY = "rlflow-dummy-turn"
    TURN = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": DUMMY}]

    def __init__(self, tokenizer, max_prompt_length: int):
        self.tok, self.max_prompt_length = tokenizer, max_prompt_length
        self.eos_text = tokenizer.eos_token or ""
        self._heads: dict[str, tuple[str, str]] = {}

    def _template(self, messages: list[dict], tools: list[dict] | None, generation: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation,
                                            tokenize=False)

    def prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        text = self._template(messages, tools, True)
        return self.tok(text, add_special_tokens=False)["input_ids"][-self.max_prompt_length:]

    def observation(self, messages: list[dict], tools: list[dict] | None, ended_with_eos: bool) -> list[int]:
        """The end of the assistant's turn (less the EOS it wrote), the observation, the next turn's header."""
        key = repr(tools)
        if key not in self._heads:
            prefix = self._template(self.TURN, tools, False)
            if self.DUMMY not in prefix:
                raise ValueError("the chat template does not render an assistant message's content")
            closing = prefix[prefix.rindex(self.DUMMY) + len(self.DUMMY):]
            self._heads[key] = (prefix, closing)
        prefix, closing = self._heads[key]
        full = self._template(self.TURN + messages, tools, True)
        if not full.startswith(prefix):
            raise ValueError("the chat template renders earlier turns differently once more follow; the "
                             "observation's tokens cannot be appended")
        if ended_with_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self.tok(closing + full[len(prefix):], add_special_tokens=False)["input_ids"]

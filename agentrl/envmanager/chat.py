"""Token-exact chat history: the first prompt through the chat template, later messages as template deltas.

The model's tokens are never re-tokenised. After a model turn we append only the tokens the chat template puts
between that turn and the next generation prompt (for ChatML: "\n<|im_start|>user\n...<|im_end|>\n<|im_start|>
assistant\n"), computed by rendering a conversation with a placeholder assistant turn and taking the suffix.
"""

from __future__ import annotations

from typing import Any

_PLACEHOLDER = "\x00AGENTRL_TURN\x00"


class ChatTokens:
    def __init__(self, tokenizer: Any, tools: list[dict] | None = None):
        self.tok = tokenizer
        self.tools = tools or None
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        # A conversation closed after a placeholder assistant turn; what the template writes after the assistant's
        # content (e.g. "<|im_end|>\n") is the turn tail.
        self._base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
        self._closed = self._render(self._base)
        self._turn_tail = self._closed[self._closed.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        self._eos_text = tokenizer.eos_token or ""

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The whole conversation so far, ending in the generation prompt."""
        return self.encode(self._render(messages, generation_prompt=True))

    def delta_ids(self, new_messages: list[dict], model_ended_with_eos: bool) -> list[int]:
        """Tokens to append after a model turn so the history equals the template render of the conversation
        plus `new_messages` and the next generation prompt."""
        extended = self._render(self._base + new_messages, generation_prompt=True)
        if not extended.startswith(self._closed):
            raise ValueError("chat template is not prefix-stable; cannot append messages as deltas")
        tail = self._turn_tail
        if model_ended_with_eos and self._eos_text and tail.startswith(self._eos_text):
            tail = tail[len(self._eos_text) :]
        return self.encode(tail + extended[len(self._closed) :])

    def model_text(self, token_ids: list[int]) -> str:
        """What the model said, without its end-of-turn token: the text an env or tool parser reads."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.eos_ids else token_ids
        return self.tok.decode(ids, skip_special_tokens=False)

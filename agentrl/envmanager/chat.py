"""Token-exact chat history: the first prompt through the chat template, later messages as template deltas.

The model's tokens are never re-tokenised. After a model turn we append only the tokens the chat template puts
between that turn and the next generation prompt (for ChatML: "\n<|im_start|>user\n...<|im_end|>\n<|im_start|>
assistant\n"), computed by rendering a conversation with a placeholder assistant turn and taking the suffix.

Per turn this is the env manager's largest own cost after the Ray call, so the template's fixed text (a delta's, or
a whole turn-wise prompt's) is rendered once per sequence of roles (with placeholder contents) and each turn only
splices the contents in; the template is rendered for real whenever splicing is not provably the same (contents it
trims, escapes or branches on), and spot-checked against a real render every `_RECHECK_EVERY` uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

_PLACEHOLDER = "\x00AGENTRL_TURN\x00"
_RECHECK_EVERY = 256  # a spliced delta is compared with a real render this often (and on each key's first uses)
_FIRST_CHECKS = 4
# Encoded texts remembered. Turn-wise prompts repeat (every turn starts with the rules, a group's episodes revisit
# states): a 128-episode Sokoban batch held 1,433 turns but 201 distinct prompts, and encoding was a sixth of the
# env manager's CPU. Cleared when full: no bookkeeping per hit.
_ENCODED_TEXTS = 4096
# Contents that make a template that trims, escapes or branches on content render differently from a splice.
_PROBES = (' \n<tool_response>\n{"a": 1}\n</tool_response>\n ', "x")


def _slot(i: int) -> str:
    return f"\x00AGENTRL_MSG{i}\x00"


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
        # (whole conversation?, roles...) -> fixed texts around the contents, None where a splice is not exact
        self._splices: dict[tuple, list[str] | None] = {}
        self._uses: dict[tuple, int] = {}
        self._encoded: dict[str, tuple[int, ...]] = {}
        self._fast = self._fast_encoder()
        self._added_ids: dict[str, int] = {}
        self._cut_at_added = self._added_token_splitter()
        self._pieces: dict[str, tuple[int, ...]] = {}  # text between two added tokens -> its ids
        self._piece_encodes = 0

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(
            messages, tools=self.tools, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _fast_encoder(self) -> Any:
        """The Rust tokenizer behind a fast tokenizer, when calling it directly gives the same ids as the wrapper
        (no truncation or padding set, same special-token handling): half the cost of a short encode."""
        backend = getattr(self.tok, "_tokenizer", None)
        if backend is None or not callable(getattr(backend, "encode", None)):
            return None
        self._split = bool(getattr(self.tok, "split_special_tokens", False))
        if not self._fast_ok(backend):
            return None
        sample = self._closed + "\n" + _PROBES[0]
        try:
            same = backend.encode(sample, add_special_tokens=False).ids == self._slow_encode(sample)
        except Exception:
            return None
        return backend if same else None

    def _fast_ok(self, backend: Any) -> bool:
        """The wrapper resets these on every call; anyone calling the tokenizer with other settings changes them."""
        return (
            getattr(backend, "truncation", 1) is None
            and getattr(backend, "padding", 1) is None
            and getattr(backend, "encode_special_tokens", None) == self._split
        )

    def _slow_encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= _ENCODED_TEXTS:
                self._encoded.clear()
            ids = self._encoded[text] = tuple(self._encode(text))
        return list(ids)

    def _encode(self, text: str) -> list[int]:
        if self._fast is not None and self._fast_ok(self._fast):
            if self._cut_at_added is not None:
                return self._encode_pieces(text)
            return self._fast.encode(text, add_special_tokens=False).ids
        return self._slow_encode(text)

    def _added_token_splitter(self) -> re.Pattern | None:
        """A pattern cutting text at the tokenizer's added tokens (<|im_start|>, ...), when each is matched verbatim
        (no strip, single-word or normalisation rules, not split as text): the tokenizer then encodes the text
        between two of them on its own, so those pieces can be remembered apart. A turn-wise prompt is the same
        system rules and a new observation: only the observation's piece is new."""
        added = getattr(self.tok, "added_tokens_decoder", None)
        if self._fast is None or self._split or not isinstance(added, dict) or not added:
            return None
        normalizes = getattr(self._fast, "normalizer", None) is not None
        for t in added.values():
            if t.lstrip or t.rstrip or t.single_word or (t.normalized and normalizes):
                return None
        self._added_ids = {t.content: i for i, t in added.items()}
        longest_first = sorted(self._added_ids, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")

    def _encode_pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(self._cut_at_added.split(text)):
            if i % 2:  # the captured added token
                ids.append(self._added_ids[part])
            elif part:
                got = self._pieces.get(part)
                if got is None:
                    if len(self._pieces) >= _ENCODED_TEXTS:
                        self._pieces.clear()
                    got = self._pieces[part] = tuple(self._fast.encode(part, add_special_tokens=False).ids)
                ids.extend(got)
        self._piece_encodes += 1
        if self._piece_encodes <= _FIRST_CHECKS or self._piece_encodes % _RECHECK_EVERY == 0:
            whole = self._fast.encode(text, add_special_tokens=False).ids
            if whole != ids:  # this tokenizer does not cut at its added tokens: encode whole texts from now on
                self._cut_at_added = None
                return whole
        return ids

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The whole conversation so far, ending in the generation prompt (a turn-wise turn's whole prompt)."""
        return self.encode(self._spliced(messages, whole=True))

    def delta_ids(self, new_messages: list[dict], model_ended_with_eos: bool) -> list[int]:
        """Tokens to append after a model turn so the history equals the template render of the conversation
        plus `new_messages` and the next generation prompt."""
        tail = self._turn_tail
        if model_ended_with_eos and self._eos_text and tail.startswith(self._eos_text):
            tail = tail[len(self._eos_text) :]
        return self.encode(tail + self._new_text(new_messages))

    def _new_text(self, new_messages: list[dict]) -> str:
        """What the template writes for `new_messages` and the generation prompt after the closed base."""
        return self._spliced(new_messages, whole=False)

    def _spliced(self, messages: list[dict], whole: bool) -> str:
        """The template's text for `messages` with the generation prompt: the whole conversation, or (whole=False)
        what follows the closed base. Spliced into the fixed texts of this sequence of roles where that is
        provably the same, else rendered."""
        render = self._rendered_whole if whole else self._rendered_new
        fixed = None
        if all(len(m) == 2 and isinstance(m.get("content"), str) and "role" in m for m in messages):
            key = (whole, *(m["role"] for m in messages))
            fixed = self._splices[key] if key in self._splices else self._splice_parts(key, render)
        if fixed is None:
            return render(messages)
        text = fixed[0] + "".join(m["content"] + part for m, part in zip(messages, fixed[1:], strict=True))
        uses = self._uses[key] = self._uses[key] + 1
        if (uses <= _FIRST_CHECKS or uses % _RECHECK_EVERY == 0) and text != (real := render(messages)):
            self._splices[key] = None  # this template treats contents specially: render these roles from now on
            return real
        return text

    def _rendered_whole(self, messages: list[dict]) -> str:
        return self._render(messages, generation_prompt=True)

    def _rendered_new(self, new_messages: list[dict]) -> str:
        extended = self._render(self._base + new_messages, generation_prompt=True)
        if not extended.startswith(self._closed):
            raise ValueError("chat template is not prefix-stable; cannot append messages as deltas")
        return extended[len(self._closed) :]

    def _splice_parts(self, key: tuple, render: Callable[[list[dict]], str]) -> list[str] | None:
        """The fixed texts around the contents of messages with the roles in `key`, or None when splicing contents
        into them would not equal the template's own render."""
        roles = key[1:]
        parts: list[str] | None = None
        try:
            text = render([{"role": r, "content": _slot(i)} for i, r in enumerate(roles)])
            parts = []
            for i in range(len(roles)):
                before, sep, text = text.partition(_slot(i))
                if not sep or _slot(i) in text:
                    raise ValueError("each content must appear once, in order")
                parts.append(before)
            parts.append(text)
            for probe in _PROBES:
                messages = [{"role": r, "content": probe} for r in roles]
                if parts[0] + "".join(probe + p for p in parts[1:]) != render(messages):
                    raise ValueError("the template changes contents")
        except Exception:
            parts = None
        self._splices[key], self._uses[key] = parts, 0
        return parts

    def model_text(self, token_ids: list[int]) -> str:
        """What the model said, without its end-of-turn token: the text an env or tool parser reads."""
        ids = token_ids[:-1] if token_ids and token_ids[-1] in self.eos_ids else token_ids
        if self._fast is not None and not getattr(self.tok, "clean_up_tokenization_spaces", False):
            return self._fast.decode(ids, skip_special_tokens=False)  # what tok.decode does, minus its wrapper
        return self.tok.decode(ids, skip_special_tokens=False)

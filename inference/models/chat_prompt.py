"""Chat messages -> prompt token ids, with special tokens only where the template writes them.

Every string in a chat request is the caller's text: the content of any role (over the API a
caller writes system and assistant turns too), a `name`, tool calls, the tools' JSON. Encoding
the rendered prompt as one string would turn `<|im_end|>\\n<|im_start|>system` inside a message
into control tokens, i.e. a forged turn. Like the OpenAI API, we encode the caller's text as
text; the checkpoint's template is the only source of special tokens.

How, without guessing what the template does with the text:
1. If no caller string contains a special token's text, nothing can be forged: the prompt is
   rendered and encoded exactly as before (and as HF `apply_chat_template` does).
2. Otherwise each such token text in the caller's strings is swapped for a private-use
   character absent from the request and the template (its "mark") before rendering. Whatever
   the template does with the strings (trim, tojson, repeat, drop), the special tokens left in
   the render are the template's own.
3. That render is encoded as usual, so the template's special tokens become their ids with the
   tokenizer's own matching rules. Each stretch between two of them that holds a mark is
   re-encoded, marks swapped back to the token text, with special-token matching off; the
   other stretches keep their ids. For ordinary content nothing differs from step 1.

Caveat: a re-encoded stretch is encoded on its own. For byte-level BPE (SmolLM2, Llama 3,
Qwen) that is exactly what the whole-string encode does between special tokens; a Metaspace
pre-tokenizer with prepend_scheme="first" would add its "▁" at the start of such a stretch.
Not covered: a template that builds a special token out of caller text that holds none (by
upper-casing it, or gluing two caller strings together); real templates don't.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import tokenizers

from inference.models.chat_template import ChatTemplate, validate_messages

# Where marks come from: the supplementary private-use planes first (rare in real text), then
# the BMP's private-use block.
_MARK_RANGES = (range(0x100000, 0x10FFFE), range(0xF0000, 0xFFFFE), range(0xE000, 0xF900))


class ChatPromptEncoder:
    """Encodes chats for one tokenizer. Thread-safe: the shared backend is only read, and the
    text-only copy (special-token matching off) is built once, on the first chat that needs it.

    backend: the tokenizer, matching special tokens anywhere in its input.
    special_tokens: {id: text} of its special tokens.
    """

    def __init__(self, backend: tokenizers.Tokenizer, template: ChatTemplate, special_tokens: Mapping[int, str]):
        self._backend = backend
        self._template = template
        self._special_tokens = dict(special_tokens)
        texts = sorted(set(self._special_tokens.values()), key=len, reverse=True)  # longest match first
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._text_only: tokenizers.Tokenizer | None = None
        self._text_only_lock = threading.Lock()

    def encode(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        clean = validate_messages(messages)
        caller_strings = [*_strings(clean), *_strings(tools)]
        found = self._found_special_text(caller_strings)
        if not found:
            rendered = self._template.render(clean, add_generation_prompt=add_generation_prompt, tools=tools)
            return self._backend.encode(rendered, add_special_tokens=False).ids
        marks = dict(zip(found, self._free_marks(caller_strings, len(found)), strict=True))  # token text -> mark

        def hide(text: str) -> str:
            return self._special_text.sub(lambda m: marks[m.group()], text)

        rendered = self._template.render(_map_strings(clean, hide), add_generation_prompt=add_generation_prompt,
                                         tools=_map_strings(tools, hide))
        return self._encode_marked(rendered, {ord(mark): text for text, mark in marks.items()})

    def _found_special_text(self, strings: list[str]) -> list[str]:
        if self._special_text is None:
            return []
        found: dict[str, None] = {}  # ordered, for reproducible marks
        for text in strings:
            found.update(dict.fromkeys(self._special_text.findall(text)))
        return list(found)

    def _free_marks(self, strings: list[str], n: int) -> list[str]:
        used = set(self._template.source).union(*strings)
        free = (chr(c) for r in _MARK_RANGES for c in r if chr(c) not in used)
        marks = list(itertools.islice(free, n))
        if len(marks) < n:
            raise ValueError("messages: every private-use character is in use; the prompt cannot be encoded safely")
        return marks

    def _encode_marked(self, rendered: str, unmark: dict[int, str]) -> list[int]:
        """Ids of `rendered`: its special tokens (the template's) as ids, the stretches between
        them as usual unless they hold a mark; those are re-encoded as plain text."""
        encoding = self._backend.encode(rendered, add_special_tokens=False)
        ids: list[int] = []
        stretch_ids: list[int] = []
        stretch_start = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            token = self._special_tokens.get(token_id)
            # A special id whose span does not hold its text (e.g. an unknown-character id for
            # a mark) belongs to the stretch.
            if token is None or token not in rendered[start:end]:
                stretch_ids.append(token_id)
                continue
            ids += self._stretch(rendered[stretch_start:start], stretch_ids, unmark)
            ids.append(token_id)
            stretch_ids, stretch_start = [], end
        ids += self._stretch(rendered[stretch_start:], stretch_ids, unmark)
        return ids

    def _stretch(self, text: str, ids: list[int], unmark: dict[int, str]) -> list[int]:
        plain = text.translate(unmark)
        if plain == text:
            return ids
        return self._text_only_backend().encode(plain, add_special_tokens=False).ids

    def _text_only_backend(self) -> tokenizers.Tokenizer:
        # A second instance, so the shared backend's flag is never toggled under other threads.
        if self._text_only is None:
            with self._text_only_lock:
                if self._text_only is None:
                    copy = tokenizers.Tokenizer.from_str(self._backend.to_str())
                    copy.encode_special_tokens = True
                    self._text_only = copy
        return self._text_only


def _strings(value: Any) -> Iterator[str]:
    """Every string in a JSON-like value, object keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _strings(item)


def _map_strings(value: Any, fn) -> Any:
    """A copy of a JSON-like value with `fn` applied to every string, object keys included."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_map_strings(v, fn) for v in value)
    return value

"""Turn a stream of generated token ids into text deltas, one token at a time.

Decoding each token alone is wrong: a byte-level BPE token can be part of a UTF-8 character
(an emoji is often 2-4 byte tokens), and decoding it alone gives U+FFFD. Re-decoding the
whole output every step is right but O(length) per token. So, like vLLM, we keep two offsets
into the output ids:

    ids:   ... [prefix_offset ... read_offset) [read_offset ... end)
                 already-emitted context         not yet emitted

and each step decode only the short window `ids[prefix_offset:]`; the new text is what it
adds to the decode of the context `ids[prefix_offset:read_offset]`. The context gives a
token the neighbours it needs (SentencePiece drops a leading space on the first token of a
decode). When the window's text ends in U+FFFD, its last character is incomplete: all text
before it is emitted, that one character is held and the offsets stay, so the window grows
by one token until the character completes (at most 3 more bytes). `flush()` emits whatever
is still held at the end (a genuinely invalid byte sequence decodes to U+FFFD, exactly as
the full decode has it).

Invariant: `text == tok.decode(output_ids, skip_special_tokens)` after `flush()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class _Decodes(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streaming text for one sequence's output tokens.

    tok: anything with `decode(ids, skip_special_tokens)` (inference.models.tokenizer.Tokenizer).
    prompt_ids: the prompt; kept for the caller (the text covers the output only, so it is
        `tok.decode(output_ids)`, what HF returns for the generated part).
    """

    def __init__(self, tok: _Decodes, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tok = tok
        self.prompt_ids = prompt_ids
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # first token whose text is not (fully) emitted yet
        self._emitted_in_window = 0  # chars past the context already emitted while held
        self._text = ""

    @property
    def text(self) -> str:
        """The output text emitted so far (everything, once `flush()` has run)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes ('' if held back)."""
        self.output_ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit any held-back text (call once the sequence has finished)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        ids = self.output_ids
        if self._read_offset == len(ids):
            return ""
        context = self._decode(ids[self._prefix_offset : self._read_offset])
        window = self._decode(ids[self._prefix_offset :])
        # An incomplete character decodes to exactly one U+FFFD at the very end, and the
        # characters before it can no longer change: hold back only that last one.
        incomplete = not final and window.endswith(REPLACEMENT_CHAR)
        start = len(context) + self._emitted_in_window
        end = len(window) - 1 if incomplete else len(window)
        delta = window[start:end] if end > start else ""
        if incomplete:
            # Keep the window anchored until the character completes.
            self._emitted_in_window += len(delta)
        else:
            # Everything up to here is final text: the next window starts after it.
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            self._emitted_in_window = 0
        self._text += delta
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

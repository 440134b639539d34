"""Turn a stream of generated token ids into text deltas, one token at a time.

Decoding each token alone is wrong: a byte-level BPE token can be part of a UTF-8 character
(an emoji is often 2-4 byte tokens), and decoding it alone gives U+FFFD. Re-decoding the
whole output every step is right but O(length) per token. `tokenizers`' own `DecodeStream`
does the windowed decode in Rust, like vLLM's two offsets:

    ids:   ... [context ...) [pending ... new]
                last emitted   fed since, not emitted yet

each step decodes only `context + pending + new`; when that text does not end in U+FFFD (an
incomplete character) the new text is what it adds to the decode of the context (which gives a
token the neighbours it needs: SentencePiece drops a leading space on the first token of a
decode), and the tokens just emitted become the next context. bench/detokenizer.py measures it
at half the cost per token of the same two decodes done from Python on English text, and about
even where most tokens are pieces of CJK or emoji characters (bench/README.md).

`DecodeStream` holds a whole token back while a character is split; here the text before the
incomplete character still goes out at once (a ' ' + lead-byte token shows its space), and
`flush()` emits whatever is still held at the end (a genuinely invalid byte sequence decodes to
U+FFFD, exactly as the full decode has it). Both need the held tokens, so this class mirrors
the stream's window (`_context`, `_pending`) and decodes it from Python only while a token is
held (part of a split character, or a skipped special token), never more than a few tokens.

Invariant: `text == tok.decode(output_ids, skip_special_tokens)` after `flush()`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import tokenizers
from tokenizers.decoders import DecodeStream

REPLACEMENT_CHAR = "\ufffd"


class _Decodes(Protocol):
    backend: tokenizers.Tokenizer

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streaming text for one sequence's output tokens.

    tok: an inference.models.tokenizer.Tokenizer (its `backend` drives the stream, its
        `decode(ids, skip_special_tokens)` the held-token path).
    prompt_ids: the prompt; kept for the caller (the text covers the output only, so it is
        `tok.decode(output_ids)`, what HF returns for the generated part).
    """

    def __init__(self, tok: _Decodes, prompt_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tok = tok
        self.prompt_ids = prompt_ids
        self.skip_special_tokens = skip_special_tokens
        self.output_ids: list[int] = []
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._context: list[int] = []  # the tokens of the stream's last emitted chunk
        self._context_text: str | None = None  # their decode, once a token is held after them
        self._pending: list[int] = []  # tokens fed to the stream since: their text is held
        self._emitted_of_pending = 0  # chars of the held text already emitted (before a split character)
        self._text = ""

    @property
    def text(self) -> str:
        """The output text emitted so far (everything, once `flush()` has run)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes ('' if held back)."""
        self.output_ids.append(token_id)
        self._pending.append(token_id)
        chunk = self._stream.step(self.tok.backend, token_id)
        if chunk is None:
            delta = self._held_delta(final=False)
        else:
            delta = chunk[self._emitted_of_pending:]
            # What the stream just emitted is its next context.
            self._context, self._pending = self._pending, []
            self._context_text = None
            self._emitted_of_pending = 0
        self._text += delta
        return delta

    def flush(self) -> str:
        """Emit any held-back text (call once the sequence has finished)."""
        delta = self._held_delta(final=True) if self._pending else ""
        self._text += delta
        return delta

    def _held_delta(self, final: bool) -> str:
        """The held tokens' text not emitted yet, up to (not including) a trailing incomplete
        character unless `final`: the characters before it can no longer change."""
        if self._context_text is None:
            self._context_text = self._decode(self._context)
        context_text = self._context_text
        window = self._decode(self._context + self._pending)
        end = len(window) - 1 if not final and window.endswith(REPLACEMENT_CHAR) else len(window)
        delta = window[len(context_text) + self._emitted_of_pending : end]
        self._emitted_of_pending += len(delta)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

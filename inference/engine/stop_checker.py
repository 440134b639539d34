"""Stop conditions on the text side: stop strings (also split across tokens) and stop token ids.

A stop string may arrive in pieces (`"###"` as `"#"`, `"##"`), so while streaming the
checker holds back the longest tail of the text that could still grow into a stop
string, and never returns the stop string itself (unless asked to include it).
"""

from __future__ import annotations

from collections.abc import Iterable


class StopChecker:
    def __init__(self, stop: Iterable[str], stop_token_ids: Iterable[int], include_stop_str: bool = False) -> None:
        self.stop = tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.include_stop_str = include_stop_str
        self._longest = max((len(s) for s in self.stop), default=0)
        self._end: int | None = None  # visible text ends here once a stop was found

    def on_token(self, token_id: int, text: str, prev_len: int) -> bool:
        """Called after each output token; `text` is the output so far, `prev_len` its length before
        this token. Returns True when the request must stop."""
        if token_id in self.stop_token_ids:
            self._end = prev_len  # the stop token's own text is never shown
            return True
        if not self.stop:
            return False
        # A new match must end inside the new text, so it starts at most longest-1 chars earlier.
        start = max(0, prev_len - self._longest + 1)
        hits = [(i, s) for s in self.stop if (i := text.find(s, start)) != -1]
        if not hits:
            return False
        index, s = min(hits)
        self._end = index + len(s) if self.include_stop_str else index
        return True

    def visible_text(self, text: str, finished: bool) -> str:
        """The part of `text` that may be shown now."""
        if self._end is not None:
            return text[: self._end]
        if finished or not self.stop:
            return text
        # Hold back a tail that is a prefix of some stop string: it may complete next token.
        for k in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return text[:-k]
        return text

"""The engine's one adapter error, importable without torch: the HTTP server maps it to a 400
and binds its port before the engine (and torch) load."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be served; `reason` says why, `adapter` names it."""

    def __init__(self, adapter: str, reason: str) -> None:
        super().__init__(f"adapter {adapter!r}: {reason}")
        self.adapter = adapter
        self.reason = reason

    def __reduce__(self):  # keep both fields across pickling (e.g. a process pool)
        return (type(self), (self.adapter, self.reason))

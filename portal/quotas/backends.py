"""Quota backends: the protocol, and the choice between them.

Both backends implement the same algorithm (see ADMIT_LUA in redis_backend.py, which is the
reference): check every limit of every scope first, then take from all of them or from none.
They differ only in where the counters live and what makes the check-and-take atomic: one
Lua script in Redis (redis_backend), one lock in this process (memory_backend).
"""

from __future__ import annotations

import threading
from typing import Protocol

from django.conf import settings

from portal.quotas.limits import AdmitOutcome, Clock, ScopeSpec, ScopeState, SettleTicket
from portal.quotas.memory_backend import MemoryQuotaBackend
from portal.quotas.redis_backend import RedisQuotaBackend


class QuotaBackend(Protocol):
    async def admit(
        self, *, scopes: tuple[ScopeSpec, ...], request_id: str, estimated_tokens: int, clock: Clock,
        estimated_spend: int = 0,
    ) -> AdmitOutcome: ...

    async def settle(self, *, ticket: SettleTicket, actual_tokens: int, clock: Clock, actual_spend: int = 0) -> bool:
        """Correct the estimates (tokens, spend units) and free the slots; False when the ticket
        was already settled."""
        ...

    def snapshot(self, *, scope: ScopeSpec, clock: Clock) -> ScopeState:
        """The scope's counters now (sync: for dashboards)."""
        ...


_memory_backend: MemoryQuotaBackend | None = None
_redis_backends: dict[str, QuotaBackend] = {}
_choice_lock = threading.Lock()


def get_backend() -> QuotaBackend:
    """Redis when settings.REDIS_URL is set, else the process's in-memory backend."""
    global _memory_backend
    url = settings.REDIS_URL
    with _choice_lock:
        if url is None:
            if _memory_backend is None:
                _memory_backend = MemoryQuotaBackend()
            return _memory_backend
        if url not in _redis_backends:
            _redis_backends[url] = RedisQuotaBackend(url)
        return _redis_backends[url]

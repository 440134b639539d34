"""The ledger of one request: written exactly once per authenticated request (the usage row,
and quota_settle with the actual tokens), from a `finally`, in a task of its own that a client
disconnect cannot cancel. Closing the worker's stream on the way (a client gone mid-stream)
makes the worker abort the request and free its KV blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from datetime import datetime

from django.utils import timezone

from portal.adapters.models import AdapterVersion
from portal.fleet.client import CompletionStream
from portal.fleet.inflight import inflight_finished, inflight_started
from portal.gateway.auth import Caller
from portal.quotas.services import Admission, quota_settle
from portal.usage.spool import usage_record_save

log = logging.getLogger(__name__)

# Tasks that must finish whoever awaited them (a reference keeps each alive until it is done).
_background: set[asyncio.Task] = set()


def run_detached(coroutine: Coroutine) -> asyncio.Task:
    """Run `coroutine` to its end even if the caller is cancelled."""
    task = asyncio.ensure_future(coroutine)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


@dataclass
class Ledger:
    """What one request did, written once: the usage row and the quota settlement."""

    request_id: str
    caller: Caller
    model: str
    stream: bool
    estimated_prompt_tokens: int = 0
    version: AdapterVersion | None = None
    admission: Admission | None = None
    upstream: CompletionStream | None = None
    worker_url: str = ""
    started_at: datetime = field(default_factory=timezone.now)
    started: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    prompt_tokens: int | None = None  # None until the worker reported usage
    completion_tokens: int | None = None
    cached_prompt_tokens: int = 0  # of prompt_tokens, found in the worker's prefix cache
    relayed_tokens: int = 0  # content / tool-call chunks relayed: the count if the usage never arrives
    constrained: str = ""  # validation.constraint_of the body: json_object, json_schema, tools or ""
    finish_reason: str = ""
    error: str = ""
    status_code: int = 200
    client_disconnected: bool = False
    _closed: bool = False
    _counted: bool = False  # in portal.fleet.inflight for worker_url until the ledger closes

    def read_usage(self, usage: dict) -> None:
        """The worker's usage object (OpenAI's shape): its token counts, as it counted them."""
        self.prompt_tokens = _count(usage.get("prompt_tokens"))
        self.completion_tokens = _count(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        self.cached_prompt_tokens = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0

    def count_in_flight(self) -> None:
        """The worker at worker_url accepted the request: it counts in routing's load until close."""
        inflight_started(self.worker_url)
        self._counted = True

    async def close(self) -> None:
        """Close the upstream and write the ledger, exactly once, surviving cancellation."""
        task = run_detached(self._finish())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            pass  # the caller is being cancelled (client gone); the task carries on

    async def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._counted:
            inflight_finished(self.worker_url)
        if self.upstream is not None:
            try:
                await self.upstream.aclose()  # mid-stream: the worker sees the disconnect and aborts
            except Exception:  # noqa: BLE001 -- closing a dead connection may fail; nothing to do
                log.debug("closing the upstream of %s failed", self.request_id, exc_info=True)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else (
            self.estimated_prompt_tokens if self.first_chunk_at is not None else 0)
        completion = self.completion_tokens if self.completion_tokens is not None else self.relayed_tokens
        if self.admission is not None:
            try:
                await quota_settle(admission=self.admission, prompt_tokens=prompt, completion_tokens=completion)
            except Exception:
                log.exception("quota_settle failed for %s", self.request_id)
        now = time.monotonic()
        fields = dict(
            request_id=self.request_id,
            tenant=self.caller.tenant,
            api_key=self.caller.api_key,
            model=self.model[:200],
            adapter_version=self.version,
            worker_url=self.worker_url,
            stream=self.stream,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cached_prompt_tokens=min(self.cached_prompt_tokens, prompt),
            constrained=self.constrained,
            time_to_first_token_ms=(
                (self.first_chunk_at - self.started) * 1000 if self.first_chunk_at is not None else None),
            latency_ms=(now - self.started) * 1000,
            finish_reason=self.finish_reason or "",
            error=self.error,
            status_code=self.status_code,
            client_disconnected=self.client_disconnected,
            created_at=self.started_at,
            finished_at=timezone.now(),
        )
        await usage_record_save(fields)  # retried, else spooled: never dropped


def _count(value) -> int:
    """A token count from a worker's JSON: a non-negative int, anything else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

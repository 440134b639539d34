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
from protocol.worker_api import RequestReport

DISK = "disk"  # protocol.worker_api.ADAPTER_TIERS: the adapter was read for the request

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
    # When the first and the last of those chunks were relayed (time.monotonic): a stream's
    # inter-token gap, as the client saw it.
    first_token_at: float | None = None
    last_token_at: float | None = None
    # The worker's report (protocol.worker_api.RequestReport): where it found the adapter, its
    # queue time, its inter-token gap (a non-streamed answer's only one).
    adapter_tier: str = ""
    queue_ms: float | None = None
    worker_inter_token_ms: float | None = None
    # The gateway loaded the adapter onto the worker for this request (relay's lazy load): the
    # worker then found it in host memory, but the request paid the read from disk.
    loaded_adapter: bool = False
    upstream_attempts: int = 0  # workers the request was sent to (relay.open_upstream)
    constrained: str = ""  # validation.constraint_of the body: json_object, json_schema, tools or ""
    completion_id: str = ""  # the answer's (or first chunk's) "id": what feedback names
    finish_reason: str = ""
    error: str = ""
    error_code: str = ""  # the OpenAI error code (else type) the client got, or that ended its stream
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

    def read_report(self, value) -> None:
        """The worker's REPORT_KEY object, if it sent one (a worker of another make sends none)."""
        report = RequestReport.from_json(value)
        if report is not None:
            self.adapter_tier = report.adapter_tier
            self.queue_ms = report.queue_ms
            self.worker_inter_token_ms = report.inter_token_ms

    def read_completion_id(self, value) -> None:
        """The completion id from the answer or a chunk; the first one the client saw is kept."""
        if not self.completion_id and isinstance(value, str):
            self.completion_id = value[:200]

    def token_relayed(self) -> None:
        """One content or tool-call chunk went to the client."""
        self.relayed_tokens += 1
        self.last_token_at = time.monotonic()
        if self.first_token_at is None:
            self.first_token_at = self.last_token_at

    def fail(self, *, status: int | None = None, message: str, code: str | None, type: str = "") -> None:
        """The request ended in an error the client was told of: an error answer (`status`), or
        an error event ending a stream that began with a 200 (status None)."""
        if status is not None:
            self.status_code = status
        self.error = message
        self.error_code = code or type or ""

    def inter_token_ms(self, completion_tokens: int) -> float | None:
        """The mean gap between tokens after the first: for a stream, between the first and the
        last token chunk relayed (what the client saw), over the gaps between its tokens; for a
        non-streamed answer, the worker's (None when it did not say)."""
        if not self.stream:
            return self.worker_inter_token_ms
        if completion_tokens < 2 or self.relayed_tokens < 2:
            return None  # one token (or one chunk carrying them all): no gap was seen
        return (self.last_token_at - self.first_token_at) * 1000 / (completion_tokens - 1)

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
            completion_id=self.completion_id,
            adapter_tier=DISK if self.loaded_adapter else self.adapter_tier,
            time_to_first_token_ms=(
                (self.first_chunk_at - self.started) * 1000 if self.first_chunk_at is not None else None),
            inter_token_ms=self.inter_token_ms(completion),
            queue_ms=self.queue_ms,
            latency_ms=(now - self.started) * 1000,
            finish_reason=self.finish_reason or "",
            error=self.error,
            error_code=self.error_code,
            status_code=self.status_code,
            client_disconnected=self.client_disconnected,
            upstream_attempts=self.upstream_attempts,
            created_at=self.started_at,
            finished_at=timezone.now(),
        )
        await usage_record_save(fields)  # retried, else spooled: never dropped


def _count(value) -> int:
    """A token count from a worker's JSON: a non-negative int, anything else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

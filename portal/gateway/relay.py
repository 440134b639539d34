"""Getting a request to a worker and its answer back to the client.

    worker_payload   the client's body as the worker gets it: the worker's model name, the tenant
                     and its scheduling weight, its cache_salt (prefix-cache isolation), the usage
                     chunk always asked for when streaming
    open_upstream    the routing order (portal.fleet.selectors.route_candidates), tried in turn:
                     a connection failure, 5xx, 404, 408 or 429 moves on to the next worker; an
                     adapter the worker does not hold is loaded there (lazy load) and asked again
                     once; any other 4xx is the client's and is relayed (adapter names scrubbed).
                     Each move to the next worker is counted (UPSTREAM_RETRIES: worker, reason)
    Completion       the worker's answer: read whole (non-streaming), or relayed chunk by chunk
                     with the public model id, the ledger fed on the way and written when the
                     stream ends or the client leaves (a stream never started is given up after
                     STREAM_START_GRACE). The worker's report (worker_api.REPORT_KEY: adapter
                     tier, queue time...) goes to the ledger and is taken out of what the client gets

Every call to a worker goes through portal.fleet.client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from portal.core.db import db_sync_to_async
from portal.core.metrics import UPSTREAM_RETRIES
from portal.fleet.client import (
    AsyncWorkerClient,
    StreamBroken,
    async_worker_client,
    version_load_body,
)
from portal.fleet.inflight import inflight_snapshot
from portal.fleet.selectors import route_candidates, route_rows
from portal.gateway import cache, observe, validation
from portal.gateway.auth import Caller
from portal.gateway.errors import GatewayError, no_worker, without_addresses
from portal.gateway.ledger import Ledger, run_detached
from portal.gateway.resolve import ModelTarget
from portal.tenants.plans import plan_for
from protocol import worker_api
from protocol.worker_api import WORKER_SIDE_LOAD_ERRORS, ErrorObject

log = logging.getLogger(__name__)

WORKER_PATHS = {validation.CHAT: worker_api.CHAT_COMPLETIONS, validation.COMPLETIONS: worker_api.COMPLETIONS}
# A streaming Completion whose chunks() never start (the client left between the worker's 200
# and the first relayed byte) is closed and written to the ledger after this long.
STREAM_START_GRACE = 30.0


def tenant_cache_salt(tenant) -> str:
    """One prefix-cache namespace per tenant (its never-reused primary key, not its slug)."""
    return f"tenant-{tenant.pk}"


def worker_payload(*, caller: Caller, body: dict, target: ModelTarget, stream: bool) -> dict:
    payload = dict(body, model=target.worker_model, tenant=caller.tenant.slug,
                   tenant_weight=plan_for(caller.tenant.plan).scheduling_weight)
    payload[worker_api.CACHE_SALT] = tenant_cache_salt(caller.tenant)
    if stream:  # the ledger needs the worker's count; the client sees the usage chunk only if it asked
        payload["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return payload


# How much of a prompt's start routing hashes: enough to tell system prompts apart, bounded so a
# long prompt costs nothing extra.
PREFIX_KEY_CHARS = 4096


def prompt_prefix_key(payload: dict) -> str | None:
    """sha256 of the cache salt (the tenant) and the prompt's start: a chat's first message (the
    system prompt, the same on every turn), a completion prompt's first PREFIX_KEY_CHARS; None
    when there is none (routing then falls back to the model alone)."""
    start = None
    messages = payload.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        first = messages[0]
        content = first.get("content")
        if isinstance(content, list):  # content parts: their text, in order
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        if isinstance(content, str):
            start = f"{first.get('role')}\n{content}"
    else:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        start = prompt if isinstance(prompt, str) else None
    if not start:
        return None
    salt = str(payload.get(worker_api.CACHE_SALT) or "")
    return hashlib.sha256(f"{salt}\0{start[:PREFIX_KEY_CHARS]}".encode()).hexdigest()[:32]


def _dumps(chunk: dict) -> str:
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))  # as the worker writes them


def _swap_model(data: str, worker_model: str, public_id: str) -> str | None:
    """The chunk's text with the public model id in place of the worker's, byte for byte
    otherwise; None when the field is not found exactly once as the worker writes it (then the
    chunk is re-encoded). Inside a JSON string a quote is escaped, so `"model":"..."` can only
    be a key."""
    field = f'"model":{json.dumps(worker_model, ensure_ascii=False)}'
    if data.count(field) != 1:
        return None
    return data.replace(field, f'"model":{json.dumps(public_id, ensure_ascii=False)}')


NULL_USAGE = ',"usage":null'


def _drop_null_usage(data: str) -> str | None:
    """The chunk's text without its `"usage":null` (what the worker adds to every chunk once asked
    for the usage chunk), byte for byte otherwise; None when not found exactly once."""
    if data.count(NULL_USAGE) != 1:
        return None
    return data.replace(NULL_USAGE, "")


def _scrub(text: Any, target: ModelTarget) -> Any:
    """Worker messages name the adapter by its internal name; clients see the public id, and
    never an internal address (a URL, IP or host:port the worker's message may carry)."""
    if isinstance(text, str) and target.version is not None:
        text = text.replace(target.worker_model, target.public_id)
    return without_addresses(text)


def _relayed(status: int, error: ErrorObject, target: ModelTarget) -> GatewayError:
    return GatewayError(
        status,
        _scrub(error.message or f"the inference worker answered {status}", target),
        type=error.type or "invalid_request_error",
        param=error.param,
        code=error.code,
    )


async def _load_adapter(client: AsyncWorkerClient, url: str, target: ModelTarget) -> str | None:
    """Ask the worker to load the version; None when loaded, else why not (this worker).
    An adapter the worker rejects is a 400 for the client (no worker would take it)."""
    reply = await client.load_adapter(url, version_load_body(version=target.version))
    if reply.exception is not None:
        return f"loading the adapter failed: {type(reply.exception).__name__}"
    if reply.ok:
        log.info("loaded %s (%s) on %s", target.public_id, target.worker_model, url)
        return None
    error = reply.error
    if reply.status == 400 and error.code in WORKER_SIDE_LOAD_ERRORS:
        # The worker could not reach or may not trust the portal: the operator's to fix, and
        # another worker may do better; the tenant's adapter is not at fault.
        log.error("worker %s could not load %s: %s", url, target.public_id, error.message)
        return f"loading the adapter failed on the worker ({error.code})"
    if reply.status == 400:
        raise GatewayError(400, f"The model `{target.public_id}` could not be loaded: {_scrub(error.message, target)}",
                           param="model", code="adapter_load_failed")
    return f"loading the adapter answered {reply.status}: {error.message}"


async def open_upstream(*, endpoint: str, payload: dict, target: ModelTarget, ledger: Ledger):
    """The first worker's accepted completion (a CompletionStream, body unread), trying the
    candidates in order; 503 no_worker_available when none takes it."""
    lora_name = target.version.worker_name if target.version is not None else None
    rows = await cache.fleet_cached("route_rows", db_sync_to_async(route_rows))
    candidates = route_candidates(lora_name=lora_name, inflight=inflight_snapshot(),
                                  prefix_key=prompt_prefix_key(payload), rows=rows)
    if not candidates:
        raise no_worker("no inference worker is configured")
    content = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    client = async_worker_client()
    failures: list[str] = []
    retry_after: int | None = None
    for position, worker in enumerate(candidates, start=1):
        url = worker.url.rstrip("/")
        ledger.upstream_attempts = position
        loaded = False
        while True:  # left by return, raise, or break: this worker failed, try the next
            observe.upstream_sending()
            reply, stream = await client.open_completion(url, path=WORKER_PATHS[endpoint], content=content)
            if stream is not None:
                ledger.worker_url = url
                ledger.loaded_adapter = loaded
                ledger.count_in_flight()
                return stream
            if reply.status is None:
                failures.append(f"{url}: {type(reply.exception).__name__}")
                reason = "unreachable"
                break
            if reply.exception is not None:
                failures.append(f"{url}: the response broke off")
                reason = "broken"
                break
            error = reply.error
            if (reply.status == 404 and target.version is not None and not loaded
                    and error.code == worker_api.MODEL_NOT_FOUND):
                why = await _load_adapter(client, url, target)
                if why is not None:
                    failures.append(f"{url}: {why}")
                    reason = "load_failed"
                    break
                loaded = True
                continue
            if reply.status >= 500 or reply.status in (404, 408, 429):
                # 404 after a load: the adapter vanished again (evicted, unloaded); try elsewhere
                failures.append(f"{url}: {reply.status} {error.message}".strip())
                if reply.retry_after is not None:
                    retry_after = max(retry_after or 0, reply.retry_after)
                reason = f"http_{reply.status}"
                break
            raise _relayed(reply.status, error, target)
        if position < len(candidates):
            UPSTREAM_RETRIES.labels(worker=url, reason=reason).inc()
    log.warning("no worker took %s: %s", ledger.request_id, "; ".join(failures))
    raise no_worker("; ".join(failures) or "every worker failed", retry_after=retry_after or 1)


@dataclass
class Completion:
    """A request the worker accepted. Non-streaming: `json` is the answer (ledger written).
    Streaming: iterate `chunks()` once; the ledger is written when it ends or is closed."""

    request_id: str
    model: str  # the public id
    stream: bool
    include_usage: bool
    headers: dict[str, str]
    target: ModelTarget
    ledger: Ledger
    json: dict | None = None
    _started: bool = False
    _watchdog: asyncio.TimerHandle | None = None

    async def read(self) -> None:
        """Non-streaming: the worker's answer into `json`, with the public model id, and its
        usage into the ledger."""
        ledger = self.ledger
        try:
            answer = await ledger.upstream.answer()
        except StreamBroken as broken:
            raise no_worker(f"the worker failed during the request: {broken.kind}") from None
        ledger.first_chunk_at = time.monotonic()
        if isinstance(answer, dict):
            answer["model"] = self.model
            ledger.read_completion_id(answer.get("id"))
            ledger.read_report(answer.pop(worker_api.REPORT_KEY, None))  # the worker's, not the client's
            ledger.read_usage(answer.get("usage") if isinstance(answer.get("usage"), dict) else {})
            choices = answer.get("choices") or [{}]
            ledger.finish_reason = str((choices[0] or {}).get("finish_reason") or "")
        self.json = answer

    def arm_watchdog(self) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(STREAM_START_GRACE, self._abandon)

    def _abandon(self) -> None:
        if not self._started:
            self._started = True
            self.ledger.client_disconnected = True
            run_detached(self.ledger.close())

    async def aclose(self) -> None:
        """Give up on a stream that will not be relayed (the ledger is still written once)."""
        if not self._started:
            self._started = True
            if self._watchdog is not None:
                self._watchdog.cancel()
            self.ledger.client_disconnected = True
            await self.ledger.close()

    async def chunks(self) -> AsyncIterator[dict]:
        """The worker's chunks with the public model id; the usage chunk only if asked for; an
        error object ({"error": {...}}) last if the worker failed mid-stream."""
        async with contextlib.aclosing(self._relayed()) as relayed:
            async for _, chunk in relayed:
                yield chunk

    async def sse(self) -> AsyncIterator[bytes]:
        """chunks() as the client's SSE events (`data: ...` and a blank line), [DONE] not
        included. A chunk nothing was taken out of goes out as the worker's own text (the model
        id swapped in place when it differs), re-encoded only when it changed otherwise."""
        async with contextlib.aclosing(self._relayed()) as relayed:
            async for data, chunk in relayed:
                cpu = time.thread_time()
                event = f"data: {data if data is not None else _dumps(chunk)}\n\n".encode()
                observe.relay_work(time.thread_time() - cpu)
                yield event

    async def _relayed(self) -> AsyncIterator[tuple[str | None, dict]]:
        """(the worker's data text when it can be relayed as is, else None; the chunk as the
        client gets it), the ledger fed on the way and written at the end."""
        if self._started:
            raise RuntimeError("a completion's chunks can be iterated once")
        self._started = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        ledger = self.ledger
        error_chunk: dict | None = None
        try:
            try:
                async for data, chunk in ledger.upstream.events():
                    cpu = time.thread_time()
                    if "error" in chunk:
                        error = ErrorObject.from_json(chunk) or ErrorObject(str(chunk["error"]), type="server_error")
                        error = dataclasses.replace(error, message=_scrub(error.message, self.target))
                        ledger.fail(message=error.message or "the worker reported an error", code=error.code,
                                    type=error.type or "server_error")
                        observe.stream_failed(error.code or error.type)
                        yield None, error.to_json()
                        continue
                    if worker_api.REPORT_KEY in chunk:
                        data = None  # the worker's report leaves the chunk: re-encoded
                    self._count(chunk)
                    model = chunk.get("model")
                    if model is not None and model != self.model:
                        chunk["model"] = self.model
                        data = _swap_model(data, model, self.model) if data is not None else None
                    if not self.include_usage:
                        if chunk.get("usage") is not None and not chunk.get("choices"):
                            continue  # the usage chunk the gateway asked for, not the client
                        if "usage" in chunk:  # null in every chunk, as the gateway asked for usage
                            del chunk["usage"]
                            data = _drop_null_usage(data) if data is not None else None
                    observe.relay_work(time.thread_time() - cpu)
                    yield data, chunk
            except StreamBroken as broken:
                if not (broken.ended and ledger.error):  # a stream that reported its error may end so
                    log.warning("%s: the inference worker failed mid-stream (%s) (%s)", self.request_id, broken,
                                ledger.worker_url)
                    error = ErrorObject(without_addresses(f"the inference worker failed mid-stream ({broken})"),
                                        type="server_error", code="worker_failed")
                    ledger.fail(message=error.message, code=error.code)
                    error_chunk = error.to_json()
                    observe.stream_failed("worker_failed")
            if error_chunk is not None:
                yield None, error_chunk
        except (asyncio.CancelledError, GeneratorExit):
            ledger.client_disconnected = True
            raise
        finally:
            await ledger.close()

    def _count(self, chunk: dict) -> None:
        """The ledger's view of one chunk: time to first token, usage, the worker's report (taken
        out of the chunk: the client gets OpenAI's shape), finish reason, tokens."""
        ledger = self.ledger
        if ledger.first_chunk_at is None:
            ledger.first_chunk_at = time.monotonic()
        ledger.read_report(chunk.pop(worker_api.REPORT_KEY, None))
        ledger.read_completion_id(chunk.get("id"))
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            ledger.read_usage(usage)
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                ledger.finish_reason = str(choice["finish_reason"])
            delta = choice.get("delta")
            if choice.get("text") or (isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls"))):
                ledger.token_relayed()

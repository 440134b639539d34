"""The gateway pipeline, one reusable async service (the /v1 views and the playground use it):

    api_key_from_authorization  Bearer sk-... → usable ApiKey (401 invalid_api_key, 403 tenant_suspended)
    completion_stream           validate → resolve model → admit quotas → route to a worker (lazy
                                adapter load, next worker on failure before the first byte) →
                                Completion: the JSON answer, or the chunks to relay
    models_list                 what /v1/models shows a caller

A Caller is a tenant and, on /v1, the API key it came with; the playground's callers are a
session's tenant with no key (every model of the tenant, the tenant's quotas alone, ledger rows
with api_key None). Both go through this one pipeline.

The ledger is written exactly once per authenticated request (usage_record_create, and
quota_settle with the actual tokens) from a `finally`, in a task of its own that a client
disconnect cannot cancel. Closing the upstream response on disconnect makes the worker abort
the request and free its KV blocks.

Nothing here knows about HTTP responses: errors are GatewayError (OpenAI's shape), streams are
dicts (chunks in OpenAI's shape, with the public model id).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from django.conf import settings
from django.utils import timezone

from portal.adapters.deployments import deployment_resolve
from portal.adapters.models import AdapterVersion
from portal.adapters.selectors import adapter_list_servable
from portal.adapters.staging import version_load_body
from portal.core.db import db_sync_to_async
from portal.fleet.selectors import base_model_name, route_candidates
from portal.gateway import validation
from portal.gateway.errors import (
    GatewayError,
    invalid_api_key,
    missing_api_key,
    model_not_found,
    no_worker,
    tenant_suspended,
    unexpected,
)
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate
from portal.keys.services import api_key_record_use
from portal.quotas.services import QuotaExceeded, quota_admit, quota_settle
from portal.tenants.models import Tenant
from portal.tenants.plans import plan_for
from portal.usage.spool import usage_record_save

log = logging.getLogger(__name__)

CHAT = validation.CHAT
COMPLETIONS = validation.COMPLETIONS
WORKER_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions"}
# The output bound assumed for the quota estimate when the request sets none.
DEFAULT_MAX_TOKENS_ESTIMATE = 256
# Worker calls: connecting is quick on a healthy network; a long generation may go quiet between
# bytes only while queued, so reads get a generous bound.
UPSTREAM_TIMEOUT = httpx.Timeout(connect=3.0, read=600.0, write=30.0, pool=30.0)
UPSTREAM_LIMITS = httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=30.0)
LOAD_TIMEOUT = httpx.Timeout(connect=3.0, read=120.0, write=30.0, pool=30.0)
# Load refusals that say nothing about the adapter (the worker's fetch from the portal failed, or
# the portal's origin is not among the worker's INFERENCE_PORTAL_ORIGINS).
WORKER_SIDE_LOAD_ERRORS = frozenset({"adapter_fetch_failed", "adapter_source_forbidden"})
BASE_NAME_TTL = 10.0  # seconds a base name learnt from a worker's /v1/models is trusted
# A streaming Completion whose chunks() never start (the client left between the worker's 200
# and the first relayed byte) is closed and written to the ledger after this long.
STREAM_START_GRACE = 30.0


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


# -- the shared HTTP client ---------------------------------------------------------------
# One pooled client per event loop (a connection belongs to the loop that opened it; uvicorn
# runs one loop per process, tests may run several).
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient] = weakref.WeakKeyDictionary()


def http_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None or client.is_closed:
        client = httpx.AsyncClient(timeout=UPSTREAM_TIMEOUT, limits=UPSTREAM_LIMITS, trust_env=False)
        _clients[loop] = client
    return client


# -- authentication -------------------------------------------------------------------------
def _authenticate(plaintext: str) -> ApiKey | None:
    api_key = api_key_authenticate(plaintext)
    if api_key is not None and api_key.tenant.is_active:
        api_key_record_use(api_key=api_key)
    return api_key


async def api_key_from_authorization(authorization: str | None) -> ApiKey:
    """The usable key named by an `Authorization: Bearer sk-...` header value."""
    if not authorization or not authorization.strip():
        raise missing_api_key()
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise invalid_api_key()
    api_key = await db_sync_to_async(_authenticate)(token)
    if api_key is None:
        raise invalid_api_key()
    if not api_key.tenant.is_active:
        raise tenant_suspended(api_key.tenant.slug)
    return api_key


# -- models ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelTarget:
    public_id: str  # what the client asked for (and sees in every response)
    worker_model: str  # what the worker is asked for: the base name or the version's worker_name
    version: AdapterVersion | None  # None: the base model


_base_cache: dict[str, tuple[float, str]] = {}


async def base_model() -> str | None:
    """The fleet's base model name: from the polled workers, else asked of a worker directly."""
    name = await db_sync_to_async(base_model_name)()
    if name:
        return name
    cached = _base_cache.get("base")
    if cached and time.monotonic() - cached[0] < BASE_NAME_TTL:
        return cached[1]
    client = http_client()
    for target in await db_sync_to_async(route_candidates)(lora_name=None):
        try:
            response = await client.get(f"{target.url.rstrip('/')}/v1/models", timeout=2.0)
            name = response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, LookupError, TypeError):
            continue
        if isinstance(name, str) and name:
            _base_cache["base"] = (time.monotonic(), name)
            return name
    return None


@dataclass(frozen=True)
class Caller:
    """Who a request is for: a tenant, through one of its API keys or (no key) its session."""

    tenant: Tenant
    api_key: ApiKey | None = None

    @classmethod
    def of_key(cls, api_key: ApiKey) -> Caller:
        return cls(api_key.tenant, api_key)


def model_allowed(caller: Caller, public_id: str) -> bool:
    """The key's allow-list: no key or None allows everything; `tenant/name` allows all its versions."""
    allowed = caller.api_key.allowed_models if caller.api_key is not None else None
    if allowed is None:
        return True
    return public_id in allowed or public_id.split("@", 1)[0] in allowed


async def model_resolve(*, caller: Caller, model: str, request_id: str = "") -> ModelTarget:
    """The base model or one of the key's tenant's ready adapter versions; 404 otherwise (the
    same answer for another tenant's adapter as for a missing one). `tenant/name` goes through
    the adapter's deployment (traffic split over versions, picked deterministically from the
    request id); `tenant/name@vN` pins a version."""
    if "/" in model:
        resolved = await db_sync_to_async(deployment_resolve)(tenant=caller.tenant, model=model, request_id=request_id)
        if resolved is None or not model_allowed(caller, resolved.public_id):
            raise model_not_found(model)
        return ModelTarget(resolved.public_id, resolved.version.worker_name, resolved.version)
    base = await base_model()
    if base is not None and model == base and model_allowed(caller, model):
        return ModelTarget(model, model, None)
    raise model_not_found(model)


def _models_list(caller: Caller, base: str | None) -> list[dict]:
    tenant = caller.tenant
    entries: list[dict] = []
    if base is not None:
        entries.append({"id": base, "object": "model", "created": 0, "owned_by": "system"})
    for adapter in adapter_list_servable(tenant=tenant).prefetch_related("versions"):
        created = int(adapter.created_at.timestamp())
        entries.append({"id": adapter.public_id, "object": "model", "created": created,
                        "owned_by": tenant.slug, "parent": base})
        for version in sorted(adapter.versions.all(), key=lambda v: v.number):
            if version.status == AdapterVersion.Status.READY:
                entries.append({"id": f"{adapter.public_id}@v{version.number}", "object": "model",
                                "created": int(version.created_at.timestamp()), "owned_by": tenant.slug,
                                "parent": base})
    return [entry for entry in entries if model_allowed(caller, entry["id"])]


async def models_list(*, caller: Caller) -> list[dict]:
    """/v1/models for this caller: the base, then each servable adapter and its ready versions."""
    return await db_sync_to_async(_models_list)(caller, await base_model())


# -- the ledger -----------------------------------------------------------------------------
_background: set[asyncio.Task] = set()


@dataclass
class Ledger:
    """What one request did, written once: the usage row and the quota settlement."""

    request_id: str
    caller: Caller
    model: str
    stream: bool
    estimated_prompt_tokens: int = 0
    version: AdapterVersion | None = None
    admission: Any = None
    upstream: httpx.Response | None = None
    worker_url: str = ""
    started_at: datetime = field(default_factory=timezone.now)
    started: float = field(default_factory=time.monotonic)
    first_chunk_at: float | None = None
    prompt_tokens: int | None = None  # None until the worker reported usage
    completion_tokens: int | None = None
    relayed_tokens: int = 0  # content chunks relayed: the count if the usage never arrives
    finish_reason: str = ""
    error: str = ""
    status_code: int = 200
    client_disconnected: bool = False
    _closed: bool = False

    async def close(self) -> None:
        """Close the upstream and write the ledger, exactly once, surviving cancellation."""
        task = asyncio.ensure_future(self._finish())
        _background.add(task)
        task.add_done_callback(_background.discard)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            pass  # the caller is being cancelled (client gone); the task carries on

    async def _finish(self) -> None:
        if self._closed:
            return
        self._closed = True
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


# -- routing --------------------------------------------------------------------------------
def _error_object(raw: bytes) -> dict:
    try:
        error = json.loads(raw)["error"]
        return error if isinstance(error, dict) else {"message": str(error)}
    except (ValueError, LookupError, TypeError):
        return {"message": raw[:500].decode("utf-8", "replace")}


def _scrub(text: Any, target: ModelTarget) -> Any:
    """Worker messages name the adapter by its internal name; clients see the public id."""
    if isinstance(text, str) and target.version is not None:
        return text.replace(target.worker_model, target.public_id)
    return text


def _relayed(status: int, error: dict, target: ModelTarget) -> GatewayError:
    return GatewayError(
        status,
        _scrub(str(error.get("message") or f"the inference worker answered {status}"), target),
        type=str(error.get("type") or "invalid_request_error"),
        param=error.get("param") if isinstance(error.get("param"), str) else None,
        code=error.get("code") if isinstance(error.get("code"), str) else None,
    )


async def _read_error(response: httpx.Response) -> bytes | None:
    try:
        return await response.aread()
    except httpx.HTTPError:
        return None
    finally:
        await response.aclose()


async def _load_adapter(client: httpx.AsyncClient, url: str, target: ModelTarget) -> str | None:
    """Ask the worker to load the version; None when loaded, else why not (this worker).
    An adapter the worker rejects is a 400 for the client (no worker would take it)."""
    version = target.version
    headers = {}
    if settings.INFERENCE_ADMIN_TOKEN:
        headers["authorization"] = f"Bearer {settings.INFERENCE_ADMIN_TOKEN}"
    try:
        response = await http_client().post(
            f"{url}/v1/load_lora_adapter", json=version_load_body(version=version),
            headers=headers, timeout=LOAD_TIMEOUT,
        )
    except httpx.HTTPError as exc:
        return f"loading the adapter failed: {type(exc).__name__}"
    if response.status_code == 200:
        log.info("loaded %s (%s) on %s", target.public_id, version.worker_name, url)
        return None
    error = _error_object(response.content)
    if response.status_code == 400 and error.get("code") in WORKER_SIDE_LOAD_ERRORS:
        # The worker could not reach or may not trust the portal: the operator's to fix, and
        # another worker may do better; the tenant's adapter is not at fault.
        log.error("worker %s could not load %s: %s", url, target.public_id, error.get("message"))
        return f"loading the adapter failed on the worker ({error.get('code')})"
    if response.status_code == 400:
        raise GatewayError(400, f"The model `{target.public_id}` could not be loaded: "
                                f"{_scrub(error.get('message'), target)}",
                           param="model", code="adapter_load_failed")
    return f"loading the adapter answered {response.status_code}: {error.get('message')}"


async def _open_upstream(endpoint: str, payload: dict, target: ModelTarget, ledger: Ledger) -> httpx.Response:
    """The first worker's 200 response (headers only, body unread), trying the candidates in
    order: a connection failure or 5xx moves on; an unknown adapter is loaded, then retried once;
    any other 4xx is the client's and is relayed."""
    lora_name = target.version.worker_name if target.version is not None else None
    candidates = await db_sync_to_async(route_candidates)(lora_name=lora_name)
    if not candidates:
        raise no_worker("no inference worker is configured")
    content = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    client = http_client()
    failures: list[str] = []
    retry_after: int | None = None
    for worker in candidates:
        url = worker.url.rstrip("/")
        loaded = False
        while True:
            request = client.build_request("POST", url + WORKER_PATHS[endpoint], content=content,
                                           headers={"content-type": "application/json"})
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as exc:
                failures.append(f"{url}: {type(exc).__name__}")
                break
            if response.status_code == 200:
                ledger.worker_url = url
                return response
            raw = await _read_error(response)
            if raw is None:
                failures.append(f"{url}: the response broke off")
                break
            error = _error_object(raw)
            if (response.status_code == 404 and target.version is not None and not loaded
                    and error.get("code") == "model_not_found"):
                why = await _load_adapter(client, url, target)
                if why is not None:
                    failures.append(f"{url}: {why}")
                    break
                loaded = True
                continue
            if response.status_code >= 500 or response.status_code in (404, 408, 429):
                # 404 after a load: the adapter vanished again (evicted, unloaded); try elsewhere
                failures.append(f"{url}: {response.status_code} {error.get('message', '')}".strip())
                header = response.headers.get("retry-after", "")
                if header.isdigit():
                    retry_after = max(retry_after or 0, int(header))
                break
            raise _relayed(response.status_code, error, target)
    log.warning("no worker took %s: %s", ledger.request_id, "; ".join(failures))
    raise no_worker("; ".join(failures) or "every worker failed", retry_after=retry_after or 1)


# -- the completion -------------------------------------------------------------------------
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

    def arm_watchdog(self) -> None:
        self._watchdog = asyncio.get_running_loop().call_later(STREAM_START_GRACE, self._abandon)

    def _abandon(self) -> None:
        if not self._started:
            self._started = True
            self.ledger.client_disconnected = True
            task = asyncio.ensure_future(self.ledger.close())
            _background.add(task)
            task.add_done_callback(_background.discard)

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
        if self._started:
            raise RuntimeError("a completion's chunks can be iterated once")
        self._started = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        ledger = self.ledger
        response = ledger.upstream
        error_chunk: dict | None = None
        try:
            done = False
            try:
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        log.warning("%s: unparsable chunk from %s", self.request_id, ledger.worker_url)
                        continue
                    if not isinstance(chunk, dict):
                        continue
                    if "error" in chunk:
                        error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                        error["message"] = _scrub(error.get("message"), self.target)
                        ledger.error = str(error.get("message") or "the worker reported an error")
                        yield {"error": error}
                        continue
                    if ledger.first_chunk_at is None:
                        ledger.first_chunk_at = time.monotonic()
                    usage = chunk.get("usage")
                    choices = chunk.get("choices") or []
                    if isinstance(usage, dict):
                        ledger.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                        ledger.completion_tokens = int(usage.get("completion_tokens") or 0)
                    for choice in choices:
                        if not isinstance(choice, dict):
                            continue
                        if choice.get("finish_reason"):
                            ledger.finish_reason = str(choice["finish_reason"])
                        delta = choice.get("delta")
                        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
                            ledger.relayed_tokens += 1
                    if "model" in chunk:
                        chunk["model"] = self.model
                    if not self.include_usage:
                        if usage is not None and not choices:
                            continue  # the usage chunk the gateway asked for, not the client
                        chunk.pop("usage", None)
                    yield chunk
                if not done and not ledger.error:
                    raise httpx.RemoteProtocolError("the stream ended without [DONE]")
            except httpx.HTTPError as exc:
                ledger.error = f"the inference worker failed mid-stream ({type(exc).__name__}: {exc})"
                log.warning("%s: %s (%s)", self.request_id, ledger.error, ledger.worker_url)
                error_chunk = {"error": {"message": ledger.error, "type": "server_error", "param": None,
                                         "code": "worker_failed"}}
            if error_chunk is not None:
                yield error_chunk
        except (asyncio.CancelledError, GeneratorExit):
            ledger.client_disconnected = True
            raise
        finally:
            await ledger.close()


async def _admit(caller: Caller, request_id: str, estimated: int):
    try:
        return await quota_admit(tenant=caller.tenant, api_key=caller.api_key, request_id=request_id,
                                 estimated_tokens=estimated)
    except QuotaExceeded as exc:
        headers = dict(getattr(exc, "headers", None) or {})
        headers["retry-after"] = str(max(1, int(exc.retry_after or 1)))
        if not exc.should_retry:
            headers["x-should-retry"] = "false"
        kind = "insufficient_quota" if not exc.should_retry else (
            "tokens" if "token" in str(exc.limit) else "requests")
        raise GatewayError(429, exc.message, type=kind, code="rate_limit_exceeded", headers=headers) from None


async def completion_rejected(*, caller: Caller, request_id: str, error: GatewayError) -> None:
    """Write the ledger row of an authenticated request refused before the pipeline (a body
    that is not JSON, too large...)."""
    ledger = Ledger(request_id=request_id, caller=caller, model="", stream=False,
                    status_code=error.status, error=error.message)
    await ledger.close()


async def completion_stream(*, caller: Caller, endpoint: str, body: dict, request_id: str) -> Completion:
    """Run the pipeline up to the worker's answer. Raises GatewayError (OpenAI shape) for
    anything that stops the request before its first byte; every such request past
    authentication is still written to the ledger once."""
    model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else ""
    ledger = Ledger(request_id=request_id, caller=caller, model=model,
                    stream=isinstance(body, dict) and body.get("stream") is True)
    streaming = False
    try:
        if not caller.tenant.is_active:  # a key's tenant was checked at authentication; a session's here
            raise tenant_suspended(caller.tenant.slug)
        validation.validate(endpoint, body)
        target = await model_resolve(caller=caller, model=body["model"], request_id=request_id)
        ledger.model = target.public_id
        ledger.version = target.version
        estimated = validation.estimate_tokens(endpoint, body, default_max_tokens=DEFAULT_MAX_TOKENS_ESTIMATE)
        ledger.estimated_prompt_tokens = validation.estimate_prompt_tokens(endpoint, body)
        ledger.admission = await _admit(caller, request_id, estimated)
        headers = dict(getattr(ledger.admission, "headers", None) or {})

        payload = dict(body, model=target.worker_model, tenant=caller.tenant.slug,
                       tenant_weight=plan_for(caller.tenant.plan).scheduling_weight)
        include_usage = validation.wants_usage_chunk(body)
        if ledger.stream:
            payload["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        response = await _open_upstream(endpoint, payload, target, ledger)
        ledger.upstream = response
        completion = Completion(request_id=request_id, model=target.public_id, stream=ledger.stream,
                                include_usage=include_usage, headers=headers, target=target, ledger=ledger)
        if ledger.stream:
            streaming = True  # from here the chunks() iterator owns the ledger
            completion.arm_watchdog()
            return completion

        try:
            raw = await response.aread()
            answer = json.loads(raw)
        except (httpx.HTTPError, ValueError) as exc:
            raise no_worker(f"the worker failed during the request: {type(exc).__name__}") from None
        ledger.first_chunk_at = time.monotonic()
        if isinstance(answer, dict):
            answer["model"] = target.public_id
            usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
            ledger.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            ledger.completion_tokens = int(usage.get("completion_tokens") or 0)
            choices = answer.get("choices") or [{}]
            ledger.finish_reason = str((choices[0] or {}).get("finish_reason") or "")
        completion.json = answer
        return completion
    except GatewayError as exc:
        ledger.status_code = exc.status
        ledger.error = exc.message
        raise
    except asyncio.CancelledError:
        ledger.client_disconnected = True
        ledger.status_code = 499
        raise
    except Exception as exc:  # noqa: BLE001 -- the database or Redis failed us: 503 / 500, in JSON
        error = unexpected(exc, request_id=request_id)
        ledger.status_code = error.status
        ledger.error = f"{error.message} ({type(exc).__name__}: {exc})"
        raise error from exc
    finally:
        if not streaming:
            await ledger.close()

"""The portal's one client for its inference workers: every call it makes to one, with the admin
token, the timeouts and the reading of answers in one place. The bodies and routes are
protocol.worker_api's, the same definitions the worker's routes use.

    load_adapter / unload_adapter / pin_adapter    staging (Celery), the gateway's lazy load
    get (/ready, /v1/models, /v1/base_model, ...)  the fleet poll (portal.fleet.probe)
    base_model_name                                the gateway, before any poll has run
    open_completion -> CompletionStream            the gateway's relay (SSE chunks or one JSON)

Two faces over one request builder (Call) and one answer type (Reply):
    WorkerClient          sync, for Celery tasks, the poll and the admin: a context manager
    AsyncWorkerClient     async, for the gateway: one pooled client per event loop
                          (async_worker_client(); a connection belongs to the loop that opened it)
A call never raises for the worker's sake: no answer is a Reply with `exception` set. Only the
admin routes carry INFERENCE_ADMIN_TOKEN; every other call carries INFERENCE_API_KEY when set (the
workers' --api-key, which they also accept the admin token for). trust_env=False everywhere: a
worker on an internal address is never reached through a proxy; redirects are not followed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import weakref
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol
from uuid import UUID

import httpx
from django.conf import settings

from protocol import worker_api
from protocol.worker_api import ErrorObject, LoadAdapterBody, UnloadAdapterBody

log = logging.getLogger(__name__)

# A poll runs every 10 s, and a worker that takes seconds to answer /ready is in trouble.
POLL_TIMEOUT = httpx.Timeout(2.0, connect=1.0)
ADMIN_TIMEOUT = httpx.Timeout(10.0, connect=3.0)  # unload, pin: bookkeeping on the worker
# Staging: the worker fetches and validates the adapter before it answers.
STAGE_LOAD_TIMEOUT = httpx.Timeout(300.0, connect=5.0)
# A lazy load: a client's request is waiting on it.
REQUEST_LOAD_TIMEOUT = httpx.Timeout(connect=3.0, read=120.0, write=30.0, pool=30.0)
MODELS_TIMEOUT = httpx.Timeout(2.0)  # the gateway asking a worker for its base model's name
# Completions: connecting is quick on a healthy network; a long generation may go quiet between
# bytes only while queued, so reads get a generous bound.
COMPLETION_TIMEOUT = httpx.Timeout(connect=3.0, read=600.0, write=30.0, pool=30.0)
COMPLETION_LIMITS = httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=30.0)
COMPLETION_PATHS = (worker_api.CHAT_COMPLETIONS, worker_api.COMPLETIONS)
DETAIL_CHARS = 300  # of a body that is not an OpenAI error, in a one-line description


# -- what workers are told about an adapter version ---------------------------------------------
class AdapterSource(Protocol):
    """What loading a version needs of it (portal.adapters.models.AdapterVersion is one)."""

    uid: UUID
    worker_name: str  # the immutable name workers know the version by
    source_path: str  # staff-registered: a directory the workers read; else empty
    file_sha256: dict  # {filename: sha256} of the stored files the workers fetch


def portal_internal_url() -> str:
    """How workers reach this portal (settings.PORTAL_INTERNAL_URL)."""
    return str(settings.PORTAL_INTERNAL_URL).rstrip("/")


def version_load_body(*, version: AdapterSource) -> LoadAdapterBody:
    """The load of one version: its path (staff-registered), else its stored files at the
    portal's internal URL, fetched with the fleet token (portal.adapters.internal_views)."""
    if version.source_path:
        return LoadAdapterBody.local(lora_name=version.worker_name, lora_path=version.source_path)
    return LoadAdapterBody.fetched(
        lora_name=version.worker_name,
        lora_url=f"{portal_internal_url()}/internal/adapters/{version.uid}/",
        files=dict(version.file_sha256 or {}),
        auth_token=settings.INFERENCE_ADMIN_TOKEN or None,
    )


# -- requests --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    """One request to a worker, built the same way by both faces."""

    method: str
    path: str
    timeout: httpx.Timeout
    body: dict | None = None  # sent as JSON
    content: bytes | None = None  # an encoded JSON body, sent as it is (a relayed completion)
    admin: bool = False  # an admin route: carries the admin token

    def request(self, http: httpx.Client | httpx.AsyncClient, url: str, *, admin_token: str | None,
                timeout: httpx.Timeout | float | None = None, api_key: str | None = None) -> httpx.Request:
        headers = {}
        token = admin_token if self.admin and admin_token else api_key
        if token:
            headers["authorization"] = f"Bearer {token}"
        content = self.content
        if self.body is not None:
            content = json.dumps(self.body, ensure_ascii=False, separators=(",", ":")).encode()
        if content is not None:
            headers["content-type"] = "application/json"
        return http.build_request(self.method, url.rstrip("/") + self.path, content=content, headers=headers,
                                  timeout=timeout if timeout is not None else self.timeout)


def load_call(body: LoadAdapterBody, *, timeout: httpx.Timeout) -> Call:
    return Call("POST", worker_api.LOAD_ADAPTER, timeout, body=body.to_json(), admin=True)


def unload_call(lora_name: str) -> Call:
    return Call("POST", worker_api.UNLOAD_ADAPTER, ADMIN_TIMEOUT, body=UnloadAdapterBody(lora_name).to_json(),
                admin=True)


def pin_call(lora_name: str, *, pinned: bool) -> Call:
    return Call("POST", worker_api.pin_path(lora_name, pinned=pinned), ADMIN_TIMEOUT, admin=True)


def get_call(path: str, *, admin: bool = False, timeout: httpx.Timeout = POLL_TIMEOUT) -> Call:
    return Call("GET", path, timeout, admin=admin)


def completion_call(path: str, content: bytes) -> Call:
    if path not in COMPLETION_PATHS:
        raise ValueError(f"not a completion route: {path}")
    return Call("POST", path, COMPLETION_TIMEOUT, content=content)


# -- answers ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """A worker's answer to one call. With `exception` the call failed in transport: status
    None if nothing came back, else the answer broke off while it was read."""

    path: str
    status: int | None = None
    body: bytes = b""
    headers: Mapping[str, str] = field(default_factory=dict)
    exception: httpx.HTTPError | None = None

    @classmethod
    def of(cls, path: str, response: httpx.Response) -> Reply:
        """From a response whose body has been read."""
        return cls(path, response.status_code, response.content, response.headers)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.exception is None

    def text(self, limit: int) -> str:
        return self.body[:limit].decode("utf-8", "replace")

    @property
    def error(self) -> ErrorObject:
        """The worker's OpenAI error object; the text of any other body stands in as its message."""
        return ErrorObject.parse(self.body) or ErrorObject(message=self.text(500), type="")

    @property
    def retry_after(self) -> int | None:
        value = self.headers.get("retry-after", "")
        return int(value) if value.isdigit() else None

    def json_object(self) -> dict:
        """The body as a JSON object; ValueError saying what it is instead."""
        try:
            body = json.loads(self.body)
        except ValueError:
            raise ValueError(f"not JSON: {self.text(80)!r}") from None
        if not isinstance(body, dict):
            raise ValueError(f"expected a JSON object, got {type(body).__name__}")
        return body

    def describe(self) -> str:
        """What went wrong, in one line (for logs, a version's staging status, a worker's last_error)."""
        if self.exception is not None:
            failure = describe_exception(self.exception)
            return failure if self.status is None else f"HTTP {self.status}, then the answer broke off: {failure}"
        detail = self.detail()
        return f"HTTP {self.status}: {detail}" if detail else f"HTTP {self.status}"

    def detail(self) -> str:
        """The useful part of an error body: the OpenAI error's message, else /ready's status and
        error, else the body itself (cut short)."""
        try:
            body = json.loads(self.body)
        except ValueError:
            return self.body.decode("utf-8", "replace").strip()[:DETAIL_CHARS]
        error = ErrorObject.from_json(body)
        if error is not None and error.message:
            return error.message
        if isinstance(body, dict):
            parts = [str(body[key]) for key in ("status", "error", "detail") if body.get(key)]
            if parts:
                return " - ".join(parts)[:DETAIL_CHARS]
        return str(body)[:DETAIL_CHARS]


def describe_exception(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__})"
    if isinstance(exc, httpx.ConnectError):
        return f"cannot connect ({type(exc).__name__}: {str(exc) or 'connection failed'})"
    return f"{type(exc).__name__}: {exc}"


class WorkerModels(NamedTuple):
    base: str  # the base model's served name
    adapters: list[str]  # names of the adapters registered there


def models_from_json(body: dict) -> WorkerModels:
    """GET /v1/models: the base is the model without a parent. ValueError when it says neither."""
    data = body.get("data")
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise ValueError("no 'data' list of models with ids")
    bases = [m["id"] for m in data if m.get("parent") is None]
    if not bases or not bases[0]:
        raise ValueError("no base model listed")
    return WorkerModels(bases[0], [m["id"] for m in data if m.get("parent") is not None])


# -- the sync face -------------------------------------------------------------------------------
class WorkerClient:
    """Calls from sync code: Celery tasks, the fleet poll, the admin. One connection pool per
    instance (safe to share between threads); close it, or use it as a context manager.
    `timeout`, when given, replaces every call's own."""

    def __init__(self, *, admin_token: str | None = None, timeout: httpx.Timeout | float | None = None,
                 api_key: str | None = None) -> None:
        self.admin_token = admin_token if admin_token is not None else settings.INFERENCE_ADMIN_TOKEN
        self.api_key = api_key if api_key is not None else settings.INFERENCE_API_KEY
        self.timeout = timeout
        self._http = httpx.Client(trust_env=False, follow_redirects=False)

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(self, url: str, call: Call) -> Reply:
        request = call.request(self._http, url, admin_token=self.admin_token, timeout=self.timeout,
                               api_key=self.api_key)
        try:
            response = self._http.send(request)
        except httpx.HTTPError as exc:
            return Reply(call.path, exception=exc)
        return Reply.of(call.path, response)

    def get(self, url: str, path: str, *, admin: bool = False) -> Reply:
        return self.send(url, get_call(path, admin=admin))

    def load_adapter(self, url: str, body: LoadAdapterBody) -> Reply:
        return self.send(url, load_call(body, timeout=STAGE_LOAD_TIMEOUT))

    def unload_adapter(self, url: str, lora_name: str) -> Reply:
        return self.send(url, unload_call(lora_name))

    def pin_adapter(self, url: str, lora_name: str, *, pinned: bool) -> Reply:
        return self.send(url, pin_call(lora_name, pinned=pinned))


# -- the async face ------------------------------------------------------------------------------
class StreamBroken(Exception):
    """A completion failed after the worker's 200: the connection broke or the answer was not
    JSON (`kind`: the error's name), or the stream ended without [DONE] (`ended`)."""

    def __init__(self, message: str, *, kind: str, ended: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.ended = ended


class CompletionStream:
    """A completion a worker accepted, its body unread: read it whole (answer) or as SSE
    chunks, once. aclose() hangs up, and the worker aborts the request and frees its KV blocks."""

    def __init__(self, url: str, response: httpx.Response) -> None:
        self.url = url
        self._response = response

    async def answer(self) -> Any:
        """The non-streamed answer, decoded."""
        try:
            return json.loads(await self._response.aread())
        except (httpx.HTTPError, ValueError) as exc:
            raise StreamBroken(f"{type(exc).__name__}: {exc}", kind=type(exc).__name__) from exc

    async def chunks(self) -> AsyncIterator[dict]:
        """The JSON object of each SSE `data:` line, an error object included, up to [DONE].
        Other lines, and data that is not a JSON object, are skipped."""
        async with contextlib.aclosing(self.events()) as events:
            async for _, chunk in events:
                yield chunk

    async def events(self) -> AsyncIterator[tuple[str, dict]]:
        """chunks(), each with its `data:` text as the worker sent it (the gateway relays that
        text as it is when nothing in the chunk changes)."""
        done = False
        try:
            async for line in self._response.aiter_lines():
                if done or not line.startswith("data:"):
                    continue  # after [DONE]: the body's end, read so the connection is kept for reuse
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    continue
                try:
                    chunk = json.loads(data)
                except ValueError:
                    log.warning("unparsable chunk from %s: %r", self.url, data[:80])
                    continue
                if isinstance(chunk, dict):
                    yield data, chunk
        except httpx.HTTPError as exc:
            if done:
                return  # the answer was whole; only its connection failed
            raise StreamBroken(f"{type(exc).__name__}: {exc}", kind=type(exc).__name__) from exc
        if not done:
            raise StreamBroken("the stream ended without [DONE]", kind="RemoteProtocolError", ended=True)

    async def aclose(self) -> None:
        await self._response.aclose()


class AsyncWorkerClient:
    """Calls from the gateway's event loop: one pooled httpx.AsyncClient (async_worker_client()
    gives the running loop's). The admin token is read per call (settings may change at run time)."""

    def __init__(self) -> None:
        self._http = httpx.AsyncClient(timeout=COMPLETION_TIMEOUT, limits=COMPLETION_LIMITS, trust_env=False)

    @property
    def is_closed(self) -> bool:
        return self._http.is_closed

    def _request(self, url: str, call: Call) -> httpx.Request:
        return call.request(self._http, url, admin_token=settings.INFERENCE_ADMIN_TOKEN,
                            api_key=settings.INFERENCE_API_KEY)

    async def send(self, url: str, call: Call) -> Reply:
        try:
            response = await self._http.send(self._request(url, call))
        except httpx.HTTPError as exc:
            return Reply(call.path, exception=exc)
        return Reply.of(call.path, response)

    async def load_adapter(self, url: str, body: LoadAdapterBody) -> Reply:
        return await self.send(url, load_call(body, timeout=REQUEST_LOAD_TIMEOUT))

    async def base_model_name(self, url: str) -> str | None:
        """The base model a worker serves (its /v1/models), or None when it cannot say."""
        reply = await self.send(url, get_call(worker_api.MODELS, timeout=MODELS_TIMEOUT))
        if not reply.ok:
            return None
        try:
            return models_from_json(reply.json_object()).base
        except ValueError:
            return None

    async def open_completion(self, url: str, *, path: str, content: bytes) -> tuple[Reply, CompletionStream | None]:
        """POST a completion. A 200 comes with its stream, body unread; any other answer is read
        (and the connection released) into the Reply."""
        call = completion_call(path, content)
        try:
            response = await self._http.send(self._request(url, call), stream=True)
        except httpx.HTTPError as exc:
            return Reply(call.path, exception=exc), None
        if response.status_code == 200:
            return Reply(call.path, 200, headers=response.headers), CompletionStream(url, response)
        try:
            await response.aread()
        except httpx.HTTPError as exc:
            return Reply(call.path, response.status_code, headers=response.headers, exception=exc), None
        finally:
            await response.aclose()
        return Reply.of(call.path, response), None


_per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncWorkerClient] = weakref.WeakKeyDictionary()


def async_worker_client() -> AsyncWorkerClient:
    """The running event loop's client (uvicorn runs one loop per process; tests may run several)."""
    loop = asyncio.get_running_loop()
    client = _per_loop.get(loop)
    if client is None or client.is_closed:
        client = AsyncWorkerClient()
        _per_loop[loop] = client
    return client

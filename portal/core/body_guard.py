"""Request bodies are bounded, and the large ones authenticated, before a byte of them is read.

Django's ASGI handler reads a whole request body into a temporary file (rolling over to disk)
before any view or middleware runs, so a view's size check or authentication comes too late:
an anonymous client could fill the disk with one 300 MiB POST and only then get its 401, and a
request declaring `Content-Length: 2 GB` and sending 100 bytes held a connection open waiting.

GuardedASGIHandler decides from the headers alone, before reading: `body_limit(scope)` may refuse
at once (401, 413) or returns how many bytes this request may send. The body is then read through
LimitedReceive: past the limit (a lying or absent Content-Length), or silent for
BODY_IDLE_TIMEOUT seconds, the client gets its 413 / 408 and Django sees a disconnect, so nothing
more is read or kept. Subclasses (the portal's pages and API, the /v1 gateway) say who may send
how much and how a refusal looks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from django.core.handlers.asgi import ASGIHandler

BODY_IDLE_TIMEOUT = 30.0  # seconds a client may pause between body chunks


class BodyRejected(Exception):
    """A request refused before (or while) reading its body."""

    def __init__(self, status: int, message: str, *, code: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.headers = dict(headers or {})


def header(scope: dict, name: str) -> str | None:
    """A request header's value (latin-1, as HTTP/1.1 carries it), the first if repeated."""
    wanted = name.lower().encode("latin-1")
    for key, value in scope.get("headers") or ():
        if key.lower() == wanted:
            return value.decode("latin-1")
    return None


def declared_length(scope: dict) -> int | None:
    """Content-Length as an int; None when absent (a chunked body, or none)."""
    value = header(scope, "content-length")
    if value is None:
        return None
    if not value.strip().isdigit():
        raise BodyRejected(400, f"Content-Length is not a number: {value[:40]!r}", code="invalid_content_length")
    return int(value.strip())


def has_body(scope: dict) -> bool:
    length = declared_length(scope)
    return (length is not None and length > 0) or header(scope, "transfer-encoding") is not None


def too_large(limit: int) -> BodyRejected:
    return BodyRejected(413, f"Request body too large: at most {limit} bytes are accepted here.",
                        code="request_too_large")


class LimitedReceive:
    """`receive` for Django's read_body: at most `limit` body bytes, each chunk within
    `idle_timeout` seconds; on a breach `reject` answers the client and Django is told the client
    left (it then stops reading and sends nothing)."""

    def __init__(self, receive: Callable[[], Awaitable[dict]], *, limit: int, idle_timeout: float,
                 reject: Callable[[BodyRejected], Awaitable[None]]):
        self._receive = receive
        self._limit = limit
        self._idle_timeout = idle_timeout
        self._reject = reject
        self._received = 0
        self._body_done = False

    async def __call__(self) -> dict:
        if self._body_done:
            return await self._receive()  # Django's disconnect listener, once the body is in
        try:
            message = await asyncio.wait_for(self._receive(), self._idle_timeout)
        except TimeoutError:
            return await self._refuse(BodyRejected(
                408, f"The request body stalled for {self._idle_timeout:.0f} s; send it whole.",
                code="request_timeout"))
        if message["type"] != "http.request":
            return message
        self._received += len(message.get("body", b""))
        if self._received > self._limit:
            return await self._refuse(too_large(self._limit))
        if not message.get("more_body", False):
            self._body_done = True
        return message

    async def _refuse(self, rejection: BodyRejected) -> dict:
        self._body_done = True
        await self._reject(rejection)
        return {"type": "http.disconnect"}


async def send_response(send, status: int, body: bytes, headers: dict[str, str]) -> None:
    """A whole response, closing the connection (the client may still be sending a body)."""
    raw_headers = [(b"content-length", str(len(body)).encode()), (b"connection", b"close")]
    raw_headers += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})


async def send_json(send, status: int, data: dict, headers: dict[str, str] | None = None) -> None:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode()
    await send_response(send, status, body, {"content-type": "application/json",
                                             "x-content-type-options": "nosniff", **(headers or {})})


class GuardedASGIHandler(ASGIHandler):
    """Django's ASGI handler with a body decision before the body is read (see the module doc)."""

    idle_timeout = BODY_IDLE_TIMEOUT

    async def body_limit(self, scope: dict) -> int:
        """How many body bytes this request may send; raise BodyRejected to refuse it unread."""
        raise NotImplementedError

    async def reject(self, scope: dict, send, rejection: BodyRejected) -> None:
        raise NotImplementedError

    async def handle(self, scope, receive, send):
        try:
            limit = await self.body_limit(scope)
            length = declared_length(scope)
            if length is not None and length > limit:
                raise too_large(limit)
        except BodyRejected as rejection:
            await self.reject(scope, send, rejection)
            return

        async def reject(rejection: BodyRejected) -> None:
            await self.reject(scope, send, rejection)

        limited = LimitedReceive(receive, limit=limit, idle_timeout=self.idle_timeout, reject=reject)
        await super().handle(scope, limited, send)

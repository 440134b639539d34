"""What the metrics (portal.core.metrics) learn about each /v1 request, each fact where it is known:

    the handler (portal.gateway.asgi)   opens a RequestObservation around the request: the status,
                                        the first body byte, the end, and the code of any error
                                        answer (every /v1 error is OpenAI-shaped JSON)
    authentication (auth)               tenant_authenticated: the tenant
    the pipeline (services)             pipeline_started: the model is "unknown" until
                                        model_resolved names its public id
    the relay                           stream_failed: an error inside a 200 stream

The observation travels in a context variable because the pipeline knows nothing of HTTP and
the playground (a websocket, not counted as a gateway request) calls it with none open: every
function here is then a no-op.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from portal.core import metrics

# The status of a request whose client left before any answer (as in the ledger).
CLIENT_CLOSED = 499


@dataclass
class RequestObservation:
    started: float = field(default_factory=time.monotonic)
    tenant: str = ""
    model: str = ""  # "" until the pipeline reads the body: /v1/models, refusals before it
    status: int | None = None
    first_byte_at: float | None = None
    error_code: str | None = None

    def wrap_send(self, send: Callable[[dict], Awaitable[None]]) -> Callable[[dict], Awaitable[None]]:
        async def observed(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = int(message["status"])
            elif message["type"] == "http.response.body" and message.get("body") and self.first_byte_at is None:
                self.first_byte_at = time.monotonic()
                if self.status is not None and self.status >= 400:
                    self.error_code = _error_code(message["body"])  # error answers are sent whole
            await send(message)

        return observed

    def finish(self) -> None:
        """Record the request (call once, when the handler is done with it)."""
        labels = {"tenant": self.tenant, "model": self.model}
        status = self.status if self.status is not None else CLIENT_CLOSED
        metrics.GATEWAY_REQUESTS.labels(**labels, status=str(status)).inc()
        metrics.GATEWAY_REQUEST_DURATION.labels(**labels).observe(time.monotonic() - self.started)
        if status == 200 and self.model not in ("", metrics.UNKNOWN) and self.first_byte_at is not None:
            metrics.GATEWAY_TIME_TO_FIRST_TOKEN.labels(**labels).observe(self.first_byte_at - self.started)
        if self.error_code is not None:
            metrics.GATEWAY_ERRORS.labels(**labels, code=self.error_code).inc()


def _error_code(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return metrics.label(error.get("code") or error.get("type"))
    except (ValueError, TypeError, KeyError, AttributeError):
        return metrics.OTHER


_current: ContextVar[RequestObservation | None] = ContextVar("loraplex_gateway_observation", default=None)


@contextmanager
def observing(observation: RequestObservation) -> Iterator[RequestObservation]:
    """The observation the calls below fill in, for the code run inside (and the tasks it starts)."""
    token = _current.set(observation)
    try:
        yield observation
    finally:
        _current.reset(token)


def tenant_authenticated(slug: str) -> None:
    if (observation := _current.get()) is not None:
        observation.tenant = slug


def pipeline_started() -> None:
    if (observation := _current.get()) is not None:
        observation.model = metrics.UNKNOWN


def model_resolved(public_id: str) -> None:
    if (observation := _current.get()) is not None:
        observation.model = public_id


def stream_failed(code: str | None) -> None:
    """An error event ended a 200 stream (the worker's error, or the worker gone mid-stream)."""
    if (observation := _current.get()) is not None:
        observation.error_code = metrics.label(code or "server_error")

"""What the metrics (portal.core.metrics) learn about each /v1 request, each fact where it is known:

    the handler (portal.gateway.asgi)   opens a RequestObservation around the request: the status,
                                        the first body byte, the end, and the code of any error
                                        answer (every /v1 error is OpenAI-shaped JSON)
    authentication (auth)               tenant_authenticated: the tenant
    the pipeline (services)             pipeline_started: the model is "unknown" until
                                        model_resolved names its public id
    the relay                           stream_failed: an error inside a 200 stream;
                                        upstream_sending and relay_work: the gateway's own time
                                        (loraplex_gateway_overhead_seconds{part})

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

from prometheus_client import Histogram

from portal.core import metrics

# The status of a request whose client left before any answer (as in the ledger).
CLIENT_CLOSED = 499

# The gateway's own time per request, fine around its goal (<= 5 ms, issue 16).
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005, 0.006, 0.0075, 0.01, 0.0125,
                    0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 1.0)
# part: to_upstream, the wall time from the request's arrival to its body going to the first
# worker tried (auth, resolution, quotas, routing; waits on the database and Redis included, so
# at concurrency 1 it is the request's own cost, under load also its queueing); relay, the CPU
# time (the event loop thread's) the relay spends on the stream's chunks, summed over the
# request; total, the two added. Defined here, not in portal.core.metrics: only the gateway
# observes it.
GATEWAY_OVERHEAD = Histogram(
    "loraplex_gateway_overhead_seconds", "The gateway's own time per completion: arrival to the upstream "
    "send (wall), the relay's per-chunk work (CPU, summed), and their total.", ["part"],
    buckets=OVERHEAD_BUCKETS, registry=metrics.REGISTRY)


@dataclass
class RequestObservation:
    started: float = field(default_factory=time.monotonic)
    tenant: str = ""
    model: str = ""  # "" until the pipeline reads the body: /v1/models, refusals before it
    status: int | None = None
    first_byte_at: float | None = None
    error_code: str | None = None
    to_upstream: float | None = None  # seconds from `started` to the first upstream send
    relay_cpu: float = 0.0  # seconds of CPU the relay spent on chunks

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
        if self.to_upstream is not None:
            GATEWAY_OVERHEAD.labels(part="to_upstream").observe(self.to_upstream)
            GATEWAY_OVERHEAD.labels(part="relay").observe(self.relay_cpu)
            GATEWAY_OVERHEAD.labels(part="total").observe(self.to_upstream + self.relay_cpu)


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


def upstream_sending() -> None:
    """The request's body is about to go to a worker (the first one tried)."""
    if (observation := _current.get()) is not None and observation.to_upstream is None:
        observation.to_upstream = time.monotonic() - observation.started


def relay_work(cpu_seconds: float) -> None:
    """The relay spent this much CPU on one chunk (time.thread_time differences)."""
    if (observation := _current.get()) is not None:
        observation.relay_cpu += cpu_seconds

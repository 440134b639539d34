"""GET /metrics: the web process's Prometheus text (portal.core.metrics), answered ahead of Django.

Ahead of Django because Prometheus scrapes each pod by its IP over plain HTTP: Django would refuse
that Host (ALLOWED_HOSTS) and redirect to https:// in production, and no page middleware is
needed for it. The Ingress never routes /metrics; the labels still name tenants and their
models, so it is not open either:

    METRICS_TOKEN set     `Authorization: Bearer <METRICS_TOKEN>` required (401 otherwise)
    unset, production     404, as if there were no such page
    unset, development    open
"""

from __future__ import annotations

import hmac

from django.conf import settings
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from portal.core.body_guard import header
from portal.core.db import db_sync_to_async
from portal.core.metrics import REGISTRY

PATH = "/metrics"


def route_metrics(app):
    """An ASGI app answering GET /metrics itself and passing everything else to `app`."""

    async def routed(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == PATH:
            return await metrics_endpoint(scope, receive, send)
        return await app(scope, receive, send)

    return routed


def _token_matches(authorization: str | None, token: str) -> bool:
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def _respond(send, status: int, body: bytes, headers: dict[str, str]) -> None:
    raw = [(b"content-length", str(len(body)).encode()), (b"cache-control", b"no-store")]
    raw += [(name.encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def metrics_endpoint(scope, receive, send) -> None:
    text = {"content-type": "text/plain; charset=utf-8"}
    token = settings.METRICS_TOKEN
    if not token and settings.CONFIG.is_production:
        return await _respond(send, 404, b"Not Found\n", text)
    if token and not _token_matches(header(scope, "authorization"), token):
        return await _respond(send, 401, b"Send the metrics token: Authorization: Bearer <METRICS_TOKEN>\n",
                              {**text, "www-authenticate": 'Bearer realm="metrics"'})
    if scope["method"] != "GET":
        return await _respond(send, 405, b"Use GET\n", {**text, "allow": "GET"})
    # The fleet's collector reads the database; off the event loop, its connection handed back.
    body = await db_sync_to_async(generate_latest, thread_sensitive=False)(REGISTRY)
    await _respond(send, 200, body, {"content-type": CONTENT_TYPE_LATEST})

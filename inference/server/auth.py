"""`--api-key` (INFERENCE_API_KEY): every route needs `Authorization: Bearer <key>`, as with
`vllm serve --api-key`, except the probes a supervisor and Prometheus call without credentials
(/health, /ready, /metrics; vLLM leaves /health and /metrics open the same way).

The admin token (--admin-token) is accepted wherever the API key is: the adapter routes check it
on top (adapters.py), so the portal sends one header, the admin token on admin calls and the API
key on everything else. A refusal is a 401 in OpenAI's error shape, code `invalid_api_key`.

A plain ASGI middleware (not FastAPI's BaseHTTPMiddleware), so streamed answers and client
disconnects pass through untouched.
"""

from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from inference.server.errors import APIError
from protocol import worker_api

PUBLIC_PATHS = frozenset({worker_api.HEALTH, worker_api.READY, worker_api.METRICS})


def bearer_matches(authorization: str | None, tokens: tuple[str, ...]) -> bool:
    """True when the header is `Bearer <one of tokens>` (compared in constant time, by digest so
    the length of a token does not leak either)."""
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(given.strip().encode()).digest()
    matched = False
    for token in tokens:
        matched |= secrets.compare_digest(digest, hashlib.sha256(token.encode()).digest())
    return matched


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str, admin_token: str | None = None) -> None:
        self.app = app
        self.tokens = (api_key,) if not admin_token else (api_key, admin_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        if not bearer_matches(Headers(scope=scope).get("authorization"), self.tokens):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <api key>' "
                                  "(the worker's --api-key / INFERENCE_API_KEY).",
                             type="invalid_request_error", code=worker_api.INVALID_API_KEY)
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

"""The /v1 gateway's own Django ASGI handler: the same URLconf and views, none of the portal's
middleware.

Each of the portal's middlewares (sessions, CSRF, auth, messages, ...) is a MiddlewareMixin whose
process_request/process_response Django runs through sync_to_async under ASGI, plus a sync-only
static-files middleware: about 13 thread hand-offs on every request before the view starts. The
gateway needs none of them (API keys, not sessions or cookies; no HTML); skipping them cut its
added time to first token at 32 concurrent streams from ~1.5 s to ~0.9 s (bench/gateway_overhead.py
on a 2-core box). Headers the security middleware gave API responses that still matter
(nosniff) are set by the gateway's views.
"""

from __future__ import annotations

from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response


class GatewayASGIHandler(ASGIHandler):
    def load_middleware(self, is_async: bool = False) -> None:
        # What BaseHandler.load_middleware builds for an empty MIDDLEWARE.
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(
            self._get_response_async if is_async else self._get_response)


PREFIX = "/v1/"


def route_gateway(portal_app, gateway_app=None):
    """An ASGI app sending HTTP requests under /v1/ to the gateway handler, the rest to the portal."""
    gateway_app = gateway_app or GatewayASGIHandler()

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            return await gateway_app(scope, receive, send)
        return await portal_app(scope, receive, send)

    return app

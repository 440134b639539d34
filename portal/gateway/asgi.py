"""The /v1 gateway's own Django ASGI handler: the same URLconf and views, none of the portal's
middleware, the key checked and the body bounded before it is read, and OpenAI-shaped JSON
whatever fails.

- No middleware. Each of the portal's middlewares (sessions, CSRF, auth, messages, ...) is a
  MiddlewareMixin whose process_request/process_response Django runs through sync_to_async
  under ASGI, plus a sync-only static-files middleware: about 13 thread hand-offs on every
  request before the view starts. The gateway needs none of them (API keys, not sessions or
  cookies; no HTML); skipping them cut its added time to first token at 32 concurrent streams
  from ~1.5 s to ~0.9 s (bench/gateway_overhead.py on a 2-core box). Headers the security
  middleware gave API responses that still matter (nosniff) are set by the gateway's views.
- Body: a request carrying one is authenticated from its headers first (401 at once, nothing
  read), then may send at most GATEWAY_MAX_BODY_BYTES (413 at once on a larger Content-Length,
  or as soon as a chunked body passes it); the authenticated key and the request id travel to
  the views in the ASGI scope (views.SCOPE_API_KEY, SCOPE_REQUEST_ID), so a refusal here and the ledger agree.
- Errors: anything a view lets escape is a JSON 500 with the request id (database or Redis
  unreachable: 503 with Retry-After), never Django's HTML page.
- Metrics: every request is observed from here (portal.gateway.observe): status, duration, time
  to the first byte, the error code it was answered.
"""

from __future__ import annotations

from django.core.handlers.exception import convert_exception_to_response
from django.http import Http404

from portal.core.body_guard import BodyRejected, GuardedASGIHandler, has_body, header, send_json
from portal.gateway import cache, observe, services
from portal.gateway.errors import GatewayError, unexpected
from portal.gateway.validation import max_body_bytes
from portal.gateway.views import SCOPE_API_KEY, SCOPE_REQUEST_ID, error_response

PREFIX = "/v1/"


class _Refused(BodyRejected):
    """A refusal the gateway's pipeline already put in OpenAI's terms (401, 403, 503)."""

    def __init__(self, error: GatewayError):
        super().__init__(error.status, error.message, code=error.code or "", headers=error.headers)
        self.error = error


def _json_errors(get_response):
    """The views' safety net: what escapes them becomes OpenAI-shaped JSON."""

    async def respond(request):
        try:
            return await get_response(request)
        except Exception as exc:  # noqa: BLE001 -- every /v1 answer is JSON, whatever failed
            request_id = request.scope.get(SCOPE_REQUEST_ID) or services.new_request_id()
            if isinstance(exc, Http404):
                error = GatewayError(404, f"Invalid URL ({request.method} {request.path})", code="unknown_url")
            else:
                error = unexpected(exc, request_id=request_id)
            return error_response(request, error, request_id)

    return respond


class GatewayASGIHandler(GuardedASGIHandler):
    def load_middleware(self, is_async: bool = False) -> None:
        # What BaseHandler.load_middleware builds for an empty MIDDLEWARE, plus the JSON net.
        self._view_middleware = []
        self._template_response_middleware = []
        self._exception_middleware = []
        self._middleware_chain = convert_exception_to_response(_json_errors(self._get_response_async))

    async def handle(self, scope, receive, send):
        scope[SCOPE_REQUEST_ID] = services.new_request_id()
        with observe.observing(observe.RequestObservation()) as observation, cache.request_scope():
            try:
                await super().handle(scope, receive, observation.wrap_send(send))
            finally:
                observation.finish()

    async def body_limit(self, scope: dict) -> int:
        if has_body(scope):
            try:
                scope[SCOPE_API_KEY] = await services.api_key_from_authorization(header(scope, "authorization"))
            except GatewayError as error:
                raise _Refused(error) from None
            except Exception as exc:  # noqa: BLE001 -- the database or its pool failed: 503, in JSON
                raise _Refused(unexpected(exc, request_id=scope[SCOPE_REQUEST_ID])) from None
        return max_body_bytes()

    async def reject(self, scope: dict, send, rejection: BodyRejected) -> None:
        request_id = scope[SCOPE_REQUEST_ID]
        if isinstance(rejection, _Refused):
            error = rejection.error
        else:  # the body itself: too large, stalled, a malformed Content-Length
            error = GatewayError(rejection.status, rejection.message, code=rejection.code, headers=rejection.headers)
            api_key = scope.get(SCOPE_API_KEY)
            if api_key is not None:  # authenticated, refused before the pipeline: on the ledger
                await services.completion_rejected(caller=services.Caller.of_key(api_key), request_id=request_id,
                                                   error=error)
        await send_json(send, error.status, error.body(), {**error.headers, "x-request-id": request_id})


def route_gateway(portal_app, gateway_app=None):
    """An ASGI app sending HTTP requests under /v1/ to the gateway handler, the rest to the portal."""
    gateway_app = gateway_app or GatewayASGIHandler()

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PREFIX):
            return await gateway_app(scope, receive, send)
        return await portal_app(scope, receive, send)

    return app

"""The portal's Django ASGI handler (pages, REST API, admin, /internal/): bodies bounded before
they are read (portal.core.body_guard).

A body up to ANONYMOUS_BODY_BYTES (sign-in forms, REST JSON) is read for anyone, as before:
the view authenticates. A larger or chunked one is an upload and must come from a signed-in
user (session cookie) or an API key (`Authorization: Bearer sk-...`) before anything is read;
it may then be up to MAX_UPLOAD_BYTES plus multipart framing. Anonymous: 401 at once; too large:
413 at once. Errors are {"detail", "code"} JSON on /api/ (as the REST API's own) and plain
text elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from types import SimpleNamespace

from django.conf import settings
from django.contrib.auth import get_user
from django.http.cookie import parse_cookie

from portal.core.body_guard import (
    BodyRejected,
    GuardedASGIHandler,
    declared_length,
    header,
    send_json,
    send_response,
)
from portal.core.db import db_sync_to_async

ANONYMOUS_BODY_BYTES = 1 << 20
# Multipart boundaries, part headers and the form's small fields around the uploaded files.
UPLOAD_FRAMING_BYTES = 1 << 20


def _session_user_is_active(session_key: str) -> bool:
    """What AuthenticationMiddleware would find: an active user behind this session."""
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(SimpleNamespace(session=store))
    return bool(user.is_authenticated and user.is_active)


class PortalASGIHandler(GuardedASGIHandler):
    """api_key_is_usable: plaintext API key -> whether it may act (portal.asgi passes the keys
    app's; core imports no app)."""

    def __init__(self, *, api_key_is_usable: Callable[[str], bool]):
        super().__init__()
        self._api_key_is_usable = api_key_is_usable

    async def authenticated(self, scope: dict) -> bool:
        """A signed-in user's session cookie or a usable API key in the request's headers."""
        authorization = header(scope, "authorization") or ""
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return await db_sync_to_async(self._api_key_is_usable)(token.strip())
        session_key = parse_cookie(header(scope, "cookie") or "").get(settings.SESSION_COOKIE_NAME)
        if session_key:
            return await db_sync_to_async(_session_user_is_active)(session_key)
        return False

    async def body_limit(self, scope: dict) -> int:
        length = declared_length(scope)
        if length is not None and length <= ANONYMOUS_BODY_BYTES:
            return ANONYMOUS_BODY_BYTES
        if not await self.authenticated(scope):
            if length is None:
                return ANONYMOUS_BODY_BYTES  # chunked: read, but no further than an anonymous body
            raise BodyRejected(401, "Sign in or send an API key (Authorization: Bearer sk-...) "
                                    f"to send more than {ANONYMOUS_BODY_BYTES} bytes.",
                               code="not_authenticated", headers={"www-authenticate": 'Bearer realm="api"'})
        return int(settings.MAX_UPLOAD_BYTES) + UPLOAD_FRAMING_BYTES

    async def reject(self, scope: dict, send, rejection: BodyRejected) -> None:
        if scope.get("path", "").startswith("/api/"):
            await send_json(send, rejection.status, {"detail": rejection.message, "code": rejection.code},
                            rejection.headers)
        else:
            await send_response(send, rejection.status, f"{rejection.message}\n".encode(),
                                {"content-type": "text/plain; charset=utf-8", **rejection.headers})

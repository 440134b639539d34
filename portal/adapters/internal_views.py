"""The portal's internal endpoint the inference workers fetch adapter files from.

    GET /internal/adapters/<version uid>/<adapter_config.json | adapter_model.safetensors>

Streams the stored file from Django's default storage (never whole in memory). Auth, always:
the shared fleet secret `Authorization: Bearer <settings.INFERENCE_ADMIN_TOKEN>` (the same token
the portal presents to the workers' adapter routes; the staging code hands it to the worker as
the load request's `auth_token`). A wrong or missing token is 401. A portal without a token
serves nothing (503): there is no loopback exception, since a reverse proxy on the same host
makes every client loopback (`make run` generates a token for its local processes).
Anything that is not a ready version's stored PEFT file is 404: unknown uid,
retired/rejected/validating versions, staff-registered versions without stored files, other
file names.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.files.storage import default_storage
from django.core.handlers.asgi import ASGIRequest
from django.http import (
    FileResponse,
    Http404,
    HttpRequest,
    HttpResponse,
    JsonResponse,
    StreamingHttpResponse,
)
from django.views.decorators.http import require_GET

from portal.adapters.models import AdapterVersion
from protocol.adapter_format import ADAPTER_FILES

CHUNK = 1 << 16


def _refusal(request: HttpRequest) -> JsonResponse | None:
    """None when the request carries the fleet token; otherwise the response refusing it."""
    token = settings.INFERENCE_ADMIN_TOKEN
    if not token:
        return JsonResponse(
            {"error": "this portal has no INFERENCE_ADMIN_TOKEN configured, so it serves no adapter files; "
                      "set the same token on the portal and its inference workers"},
            status=503,
        )
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode()):
        return None
    response = JsonResponse({"error": "Authorization: Bearer <INFERENCE_ADMIN_TOKEN> required"}, status=401)
    response["WWW-Authenticate"] = "Bearer"
    return response


@require_GET
def adapter_file(request: HttpRequest, uid, filename: str) -> HttpResponse:
    if (refusal := _refusal(request)) is not None:
        return refusal
    if filename not in ADAPTER_FILES:
        raise Http404("no such file")
    version = (
        AdapterVersion.objects.filter(uid=uid, status=AdapterVersion.Status.READY, retired_at__isnull=True)
        .exclude(storage_dir="")
        .only("storage_dir", "file_sha256")
        .first()
    )
    if version is None or filename not in (version.file_sha256 or {}):
        raise Http404("no such adapter version")
    name = f"{version.storage_dir}/{filename}"
    try:
        handle = default_storage.open(name, "rb")
    except FileNotFoundError:
        raise Http404("no such file") from None
    size = _size(name)
    if isinstance(request, ASGIRequest):
        # Under ASGI a sync iterator would be read whole before the first byte is sent.
        response = StreamingHttpResponse(_chunks_async(handle), content_type="application/octet-stream")
    else:
        response = FileResponse(handle, content_type="application/octet-stream")
    if size is not None:
        response["Content-Length"] = str(size)
    response["X-Content-SHA256"] = version.file_sha256[filename]
    response["Cache-Control"] = "private, no-store"
    return response


def _size(name: str) -> int | None:
    try:
        return default_storage.size(name)
    except (NotImplementedError, OSError):
        return None


async def _chunks_async(handle) -> AsyncIterator[bytes]:
    try:
        while chunk := await sync_to_async(handle.read, thread_sensitive=False)(CHUNK):
            yield chunk
    finally:
        await sync_to_async(handle.close, thread_sensitive=False)()

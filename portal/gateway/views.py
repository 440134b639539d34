"""/v1: the OpenAI-compatible API. Async views, no thread held per stream: the pipeline is
portal.gateway.services; these views only read HTTP, call it and write HTTP (errors in OpenAI's
shape, x-request-id on every response, SSE for streams).

Served by portal.gateway.asgi.GatewayASGIHandler, which has already authenticated a request with
a body (SCOPE_API_KEY) and chosen its request id (SCOPE_REQUEST_ID) before reading the body;
under another handler (WSGI) the views do both themselves.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from portal.core.exceptions import InvalidInput
from portal.gateway import services
from portal.gateway.errors import GatewayError, unexpected
from portal.gateway.validation import max_body_bytes, parse_json_object
from portal.rollouts.services import CompletionNotFound, feedback_record

SCOPE_API_KEY = "loraplex.api_key"
SCOPE_REQUEST_ID = "loraplex.request_id"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer tokens
DONE = b"data: [DONE]\n\n"


def _dumps(data: dict) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _with_ids(response: HttpResponse, request: HttpRequest, request_id: str, headers: dict | None = None) -> HttpResponse:
    for name, value in (headers or {}).items():
        response[name] = value
    response["x-request-id"] = request_id
    response["X-Content-Type-Options"] = "nosniff"  # no SecurityMiddleware on /v1 (portal.gateway.asgi)
    client_id = request.headers.get("x-request-id") or request.headers.get("x-client-request-id")
    if client_id:
        # the client's own id is echoed apart: ours is the one the ledger knows
        response["x-client-request-id"] = client_id[:200].encode("latin-1", "replace").decode("latin-1")
    return response


def error_response(request: HttpRequest, exc: GatewayError, request_id: str) -> HttpResponse:
    return _with_ids(JsonResponse(exc.body(), status=exc.status), request, request_id, exc.headers)


def _method_not_allowed(request: HttpRequest, allowed: str, request_id: str) -> HttpResponse:
    exc = GatewayError(405, f"{request.method} is not allowed here; use {allowed}",
                       code="method_not_allowed", headers={"allow": allowed})
    return error_response(request, exc, request_id)


def _body(request: HttpRequest) -> dict:
    # Not request.body: its DATA_UPLOAD_MAX_MEMORY_SIZE (the portal's forms) is not the API's
    # limit. The handler stopped anything longer than max_body_bytes() before it was read.
    limit = max_body_bytes()
    raw = request.read(limit + 1)
    if len(raw) > limit:
        raise GatewayError(413, f"Request body too large: at most {limit} bytes are accepted here.",
                           code="request_too_large")
    return parse_json_object(raw)


async def _sse(completion: services.Completion) -> AsyncIterator[bytes]:
    events = completion.sse()
    try:
        async for event in events:
            yield event
        yield DONE
    finally:
        await events.aclose()  # runs the ledger at once, whoever stops the iteration
        await completion.aclose()  # (a no-op once chunks() started)


def _request_id(request: HttpRequest) -> str:
    scope = getattr(request, "scope", None) or {}
    return scope.get(SCOPE_REQUEST_ID) or services.new_request_id()


async def _api_key(request: HttpRequest):
    scope = getattr(request, "scope", None) or {}
    api_key = scope.get(SCOPE_API_KEY)
    if api_key is None:
        api_key = await services.api_key_from_authorization(request.headers.get("authorization"))
    return api_key


async def _completion(request: HttpRequest, endpoint: str) -> HttpResponse:
    request_id = _request_id(request)
    if request.method != "POST":
        return _method_not_allowed(request, "POST", request_id)
    try:
        caller = services.Caller.of_key(await _api_key(request))
        try:
            body = _body(request)
        except GatewayError as exc:
            await services.completion_rejected(caller=caller, request_id=request_id, error=exc)
            raise
        completion = await services.completion_stream(
            caller=caller, endpoint=endpoint, body=body, request_id=request_id)
    except GatewayError as exc:
        return error_response(request, exc, request_id)
    except Exception as exc:  # noqa: BLE001 -- the database, Redis... : OpenAI-shaped, never HTML
        return error_response(request, unexpected(exc, request_id=request_id), request_id)
    if not completion.stream:
        return _with_ids(JsonResponse(completion.json, safe=False), request, request_id, completion.headers)
    response = StreamingHttpResponse(_sse(completion), content_type="text/event-stream", headers=SSE_HEADERS)
    return _with_ids(response, request, request_id, completion.headers)


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse:
    return await _completion(request, services.CHAT)


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponse:
    return await _completion(request, services.COMPLETIONS)


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    request_id = _request_id(request)
    if request.method != "GET":
        return _method_not_allowed(request, "GET", request_id)
    try:
        data = await services.models_list(caller=services.Caller.of_key(await _api_key(request)))
    except GatewayError as exc:
        return error_response(request, exc, request_id)
    except Exception as exc:  # noqa: BLE001 -- the database unreachable...: OpenAI-shaped, never HTML
        return error_response(request, unexpected(exc, request_id=request_id), request_id)
    return _with_ids(JsonResponse({"object": "list", "data": data}), request, request_id)


@csrf_exempt
async def feedback(request: HttpRequest) -> HttpResponse:
    """POST {"id": completion id, "rating": "up"|"down", "comment"?}: the tenant's rating of one of
    its completions (one per completion from the API; a second call replaces it)."""
    request_id = _request_id(request)
    if request.method != "POST":
        return _method_not_allowed(request, "POST", request_id)
    try:
        caller = services.Caller.of_key(await _api_key(request))
        body = _body(request)
        comment = body.get("comment", "")
        if comment is not None and not isinstance(comment, str):
            raise GatewayError(400, "comment: must be a string", param="comment", code="invalid_value")
        try:
            record = await sync_to_async(feedback_record)(
                tenant=caller.tenant, completion_id=body.get("id"), rating=body.get("rating"),
                comment=comment or "", source="api")
        except InvalidInput as error:
            raise GatewayError(400, str(error), param=error.field, code="invalid_value") from None
        except CompletionNotFound as error:
            raise GatewayError(404, error.message, param="id", code="completion_not_found") from None
    except GatewayError as exc:
        return error_response(request, exc, request_id)
    except Exception as exc:  # noqa: BLE001 -- the database unreachable...: OpenAI-shaped, never HTML
        return error_response(request, unexpected(exc, request_id=request_id), request_id)
    return _with_ids(JsonResponse({"object": "feedback", "id": record.completion_id, "rating": record.rating,
                                   "comment": record.comment, "created_at": int(record.created_at.timestamp()),
                                   "updated_at": int(record.updated_at.timestamp())}), request, request_id)


@csrf_exempt
async def not_found(request: HttpRequest, path: str = "") -> HttpResponse:
    exc = GatewayError(404, f"Invalid URL ({request.method} /v1/{path})", code="unknown_url")
    return error_response(request, exc, _request_id(request))

"""Every error the API returns, in OpenAI's shape (protocol.worker_api.ErrorObject, the object
the portal reads back), mapped in one place.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": null}}

Bad input is always a 4xx naming the parameter: pydantic validation errors, the engine's
ValueError("field: reason"), unknown models and adapters. Only our own bugs are 500s.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from protocol import worker_api
from protocol.worker_api import ErrorObject

log = logging.getLogger(__name__)

# The engine and SamplingParams start their messages with the field: "prompt: ...", "top_p must be ...".
_FIELD = re.compile(r"^(messages|[a-z_]+(?:\[\d+\])?(?:\.[a-z_]+)*)(?=:| must| is| do)")
# How pydantic labels union members in an error location ("str", "list[int]", "function-after[...]").
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\])$")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return ErrorObject(self.message, type=self.type, param=self.param, code=self.code).to_json()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", param="model",
                    code=worker_api.MODEL_NOT_FOUND)


def from_value_error(exc: ValueError, *, prompt_param: str = "prompt") -> APIError:
    """An engine/SamplingParams ValueError as a 400; the prompt's field is `messages` for chat."""
    message = str(exc)
    m = _FIELD.match(message)
    param = m.group(1) if m else None
    if param in ("prompt", "messages") or (param or "").startswith("messages["):
        if param == "prompt":
            param = prompt_param
        if "context length" in message:
            return APIError(400, message, param=prompt_param, code="context_length_exceeded")
    return APIError(400, message, param=param)


def _loc_to_param(loc: tuple) -> str | None:
    """("body", "messages", 0, "role") → "messages[0].role"; union branch names are dropped."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and _UNION_TAG.match(p):
            continue  # pydantic names the union member it tried ("list[str]"): not a parameter
        else:
            out += f".{p}" if out else p
    return out or None


def from_validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, f"request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    param = _loc_to_param(tuple(first.get("loc", ())))
    if first.get("type") == "model_attributes_type" or param is None:
        return APIError(400, f"request body must be a JSON object: {first['msg']}")
    message = f"{param}: {first['msg']}"
    if len(errors) > 1:
        others = sorted({p for e in errors[1:] if (p := _loc_to_param(tuple(e.get("loc", ())))) and p != param})
        if others:
            message += f" (also invalid: {', '.join(others)})"
    # OpenAI's code for a parameter the model does not take (protocol.UNSUPPORTED_*_FIELDS).
    code = worker_api.UNSUPPORTED_PARAMETER if first.get("type") == worker_api.UNSUPPORTED_PARAMETER else None
    return APIError(400, message, param=param, code=code)


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}", type="internal_server_error").response()

"""Server-sent events as OpenAI streams them: `data: {json}` events, then `data: [DONE]`."""

from __future__ import annotations

import json

from inference.server.errors import APIError

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies must not buffer tokens


def event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_event(error: APIError) -> str:
    """An error after the stream began (the status line is already sent): one event with the
    error object, as OpenAI and vLLM send it; the SDK raises it as an APIError."""
    return event(error.body())

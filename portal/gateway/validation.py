"""Edge validation of /v1 request bodies: what the gateway itself relies on.

The gateway reads `model`, `messages`/`prompt`, `stream`, `stream_options`, `max_tokens`,
`max_completion_tokens` and `n` (to resolve, estimate quota and relay), so those are checked
here with OpenAI's strictness (no coercions: "5" is not an integer, 1 is not a boolean) and a
400 naming the parameter. Every other sampling field passes through to the inference worker
untouched (response_format, tools, tool_choice, logit_bias... included), which validates it
strictly and answers its own 400 in the same shape; constraint_of only reads the first three for
the ledger.
"""

from __future__ import annotations

import json
import re
from typing import Any

from django.conf import settings

from portal.gateway.errors import GatewayError
from protocol.worker_api import CACHE_SALT

CHAT = "chat"
COMPLETIONS = "completions"
MAX_CHOICES = 128  # the worker's bound on n × prompts
# The largest max_tokens taken: far beyond any context window, small enough that the quota's
# estimate (this × n × prompts) stays an exact integer in Redis's Lua (a double) and in int64.
MAX_OUTPUT_TOKENS = 2**31 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_CONTROL = re.compile("[\x00-\x1f\x7f]")
# Fields only the gateway may set: the worker's fair scheduler trusts the tenant, and its prefix
# cache shares KV only within one cache_salt (the tenant's), so no caller can time another's hits.
GATEWAY_FIELDS = ("tenant", "tenant_weight", CACHE_SALT)


def max_body_bytes() -> int:
    return int(settings.GATEWAY_MAX_BODY_BYTES)


def bad(param: str | None, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}" if param else message, param=param)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    if not raw:
        raise bad(None, "request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
        body = json.loads(text, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise bad(None, "request body is not UTF-8") from None
    except (ValueError, RecursionError) as exc:
        raise bad(None, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad(None, f"request body must be a JSON object, got {type(body).__name__}")
    if "\\u" in text:  # only a \uXXXX escape can make a lone surrogate: UTF-8 bytes cannot
        _check_no_lone_surrogates(body)
    return body


def _check_no_lone_surrogates(value: Any, where: str = "") -> None:
    """A JSON string may escape half a UTF-16 pair ("\\ud800"): not a character, unstorable and
    unencodable, so a 400 naming where it is rather than a failure further down."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise bad(path or None, "contains a lone UTF-16 surrogate escape (e.g. \\ud800), which is "
                                        "not a Unicode character")
        elif isinstance(item, dict):
            for key, child in item.items():
                if _SURROGATE.search(key):
                    raise bad(path or None, "an object key contains a lone UTF-16 surrogate escape")
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_positive_int(body: dict, name: str, *, maximum: int, minimum: int = 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad(name, f"must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise bad(name, f"must be at least {minimum}, got {value}")
    if value > maximum:
        raise bad(name, f"must be at most {maximum}, got {value}")
    return value


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list):
        raise bad("messages", f"must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise bad("messages", "must contain at least one message")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(where, f"must be an object, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise bad(f"{where}.role", "is required and must be a string")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}]", "must be a text part {\"type\": \"text\", \"text\": ...}")


def _check_prompt(prompt: Any) -> int:
    """The number of prompts in `prompt`; 400 unless str | list[int] | list[str | list[int]]."""
    if isinstance(prompt, str):
        return 1
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", "must be a string, a list of token ids, or a non-empty list of those")
    if all(_is_int(t) for t in prompt):
        return 1
    for i, item in enumerate(prompt):
        if isinstance(item, str):
            continue
        if isinstance(item, list) and item and all(_is_int(t) for t in item):
            continue
        raise bad(f"prompt[{i}]", "must be a string or a non-empty list of token ids")
    return len(prompt)


def validate(endpoint: str, body: dict) -> dict:
    """Check what the gateway relies on; returns the body (unchanged) or raises a 400."""
    if not isinstance(body, dict):
        raise bad(None, "request body must be a JSON object")
    model = body.get("model")
    if model is None:
        raise bad("model", "is required")
    if not isinstance(model, str) or not model.strip():
        raise bad("model", "must be a non-empty string")
    if len(model) > 300:
        raise bad("model", "is too long")
    if _CONTROL.search(model):
        raise bad("model", "must not contain control characters")
    if endpoint == CHAT:
        if "messages" not in body:
            raise bad("messages", "is required")
        _check_messages(body["messages"])
        prompts = 1
    else:
        if "prompt" not in body:
            raise bad("prompt", "is required")
        prompts = _check_prompt(body["prompt"])
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream", f"must be a boolean, got {type(stream).__name__}")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        if not stream:
            raise bad("stream_options", "only allowed when stream is true")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise bad("stream_options.include_usage", "must be a boolean")
    # Completions take max_tokens 0 (with echo: the prompt is scored, nothing generated; the
    # worker refuses it without echo), as vLLM does for evaluation harnesses.
    _optional_positive_int(body, "max_tokens", maximum=MAX_OUTPUT_TOKENS, minimum=0 if endpoint == COMPLETIONS else 1)
    if endpoint == CHAT:
        _optional_positive_int(body, "max_completion_tokens", maximum=MAX_OUTPUT_TOKENS)
    n = _optional_positive_int(body, "n", maximum=MAX_CHOICES) or 1
    if n * prompts > MAX_CHOICES:
        raise bad("n", f"asks for {n * prompts} choices; at most {MAX_CHOICES} per request")
    for name in GATEWAY_FIELDS:
        if name in body:
            raise bad(name, "is set by the gateway from your API key; do not send it")
    return body


def constraint_of(body: Any) -> str:
    """What the request asks to shape its answer, for the ledger (UsageRecord.constrained):
    "tools" when tools are given and a call may be made (tool_choice other than "none"), else the
    response_format type when it is "json_object" or "json_schema", else "". Reads any body, valid
    or not: the worker validates these fields; a request it refuses is still marked."""
    if not isinstance(body, dict):
        return ""
    tools = body.get("tools")
    if isinstance(tools, list) and tools and body.get("tool_choice") != "none":
        return "tools"
    response_format = body.get("response_format")
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    return kind if kind in ("json_object", "json_schema") else ""


def wants_stream(body: dict) -> bool:
    return bool(body.get("stream"))


def wants_usage_chunk(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return bool(options.get("include_usage"))


def max_output_tokens(body: dict, *, default: int) -> int:
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:  # 0 (completions with echo) is a bound too
            return body[name]
    return default


def estimate_prompt_tokens(endpoint: str, body: dict) -> int:
    """Prompt characters / 4 (a validated body; a chat's tool definitions included, which the
    worker writes into the prompt): the quota estimate before the worker counts."""
    chars = 0
    if endpoint == CHAT:
        for message in body["messages"]:
            content = message.get("content")
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(part["text"]) for part in content)
            chars += 8  # the template's role markers
        chars += _tools_chars(body.get("tools"))
    else:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            chars = len(prompt)
        elif all(_is_int(t) for t in prompt):
            chars = 4 * len(prompt)
        else:
            chars = sum(len(p) if isinstance(p, str) else 4 * len(p) for p in prompt)
    return chars // 4


def _tools_chars(tools: Any) -> int:
    """The tool definitions' JSON length: the worker writes them into the prompt."""
    if not isinstance(tools, list) or not tools:
        return 0
    try:
        return len(json.dumps(tools, separators=(",", ":")))
    except (TypeError, ValueError, RecursionError):
        return 0


def estimate_tokens(endpoint: str, body: dict, *, default_max_tokens: int) -> int:
    """What a request may cost before it runs: the prompt estimate plus the output bound per
    choice (quota admission takes this; settlement replaces it with the worker's count)."""
    prompts = 1
    if endpoint == COMPLETIONS and isinstance(body["prompt"], list) and not all(_is_int(t) for t in body["prompt"]):
        prompts = len(body["prompt"])
    n = body.get("n") or 1
    output = max_output_tokens(body, default=default_max_tokens) * n * prompts
    return max(1, estimate_prompt_tokens(endpoint, body) + output)

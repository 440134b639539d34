"""`response_format` and `logit_bias` of a request, checked at the edge and turned into what the
engine takes (StructuredOutput, {token id: bias}). Every bad value is a 400 naming the parameter.

    {"type": "text"}                                   plain text (the default)
    {"type": "json_object"}                            one JSON object
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": {...}, "strict": true}}
                                                       an instance of the schema

The output is constrained by a grammar whatever `strict` says (OpenAI's non-strict mode only
"tries"; we always hold to the schema). Whether the engine can compile a schema is known only
once it compiled it: `check` awaits that before the request is added, so a schema it cannot use
is a 400 (param response_format) and never fails a running batch.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from inference.server.errors import APIError

if TYPE_CHECKING:  # imported when used: the engine's modules (torch) load after the server bound
    from inference.engine.structured_output import StructuredOutput, StructuredOutputError

SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
LOGIT_BIAS_LIMIT = 100  # OpenAI: each bias is in [-100, 100]


def response_format(value: Any) -> StructuredOutput | None:
    """The structured output `response_format` asks for; None for plain text."""
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, Mapping) or not isinstance(value.get("type"), str):
        raise APIError(400, 'response_format: expected {"type": "text" | "json_object" | "json_schema", ...}',
                       param=param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        from inference.engine.structured_output import StructuredOutput

        return StructuredOutput.json_object()
    if kind != "json_schema":
        raise APIError(400, f'response_format.type: unknown type {kind!r}: expected "text", "json_object" '
                            'or "json_schema"', param=param)
    spec = value.get("json_schema")
    if not isinstance(spec, Mapping):
        raise APIError(400, 'response_format.json_schema: expected {"name": ..., "schema": {...}}', param=param)
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise APIError(400, "response_format.json_schema.name: expected 1 to 64 of a-z, A-Z, 0-9, _ and -",
                       param=param)
    for key, kind_name in (("description", "a string"), ("strict", "true or false")):
        item = spec.get(key)
        if item is not None and not isinstance(item, bool if key == "strict" else str):
            raise APIError(400, f"response_format.json_schema.{key}: expected {kind_name}", param=param)
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise APIError(400, "response_format.json_schema.schema: expected a JSON schema object", param=param)
    return schema_output(schema, param=param)


def schema_output(schema: Mapping, *, param: str, part: str | None = None) -> StructuredOutput:
    """StructuredOutput.json_schema(schema), a 400 for `param` when it is refused (too large);
    `part`: the request part the schema came from, when not response_format (see as_api_error)."""
    from inference.engine.structured_output import StructuredOutput, StructuredOutputError

    try:
        return StructuredOutput.json_schema(schema)
    except StructuredOutputError as exc:
        raise as_api_error(exc, param=param, part=part) from None


def lark_output(grammar: str, *, param: str, part: str) -> StructuredOutput:
    """StructuredOutput.lark(grammar) built by the server (forced tool calls), a 400 for `param`
    naming `part` when it is refused (too large)."""
    from inference.engine.structured_output import StructuredOutput, StructuredOutputError

    try:
        return StructuredOutput.lark(grammar)
    except StructuredOutputError as exc:
        raise as_api_error(exc, param=param, part=part) from None


def as_api_error(exc: StructuredOutputError, *, param: str, part: str | None = None) -> APIError:
    """The engine's refusal of a grammar as a 400 for `param`. Its message starts with the
    request part the engine assumed (`exc.field`); `part` replaces that (a tool's parameters)."""
    message = str(exc)
    if part is not None and message.startswith(f"{exc.field}: "):
        message = f"{part}: {message[len(exc.field) + 2:]}"
    return APIError(400, message, param=param)


def logit_bias(value: Any, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's logit_bias {"<token id>": bias in [-100, 100]} as {token id: bias}; None if empty."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise APIError(400, 'logit_bias: expected an object {"<token id>": <bias from -100 to 100>}',
                       param="logit_bias")
    biases: dict[int, float] = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) < vocab_size):
            raise APIError(400, f"logit_bias: key {key!r} is not a token id (0..{vocab_size - 1})", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not math.isfinite(bias) \
                or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise APIError(400, f"logit_bias[{key!r}]: expected a number from -{LOGIT_BIAS_LIMIT} to "
                                f"{LOGIT_BIAS_LIMIT}, got {bias!r}", param="logit_bias")
        biases[int(key)] = float(bias)
    return biases or None

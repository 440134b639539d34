"""The playground's entry into the gateway pipeline for a tenant authenticated by its session:
the same validation, model resolution, quotas, routing, lazy adapter load and usage ledger as
/v1 (portal.gateway.services), for a Caller with no API key; the check of a side-by-side chat's
models before any of its columns starts (playground_columns_check); the thumbs up/down on an
answer (playground_feedback); and the request fields the page's optional structured-output boxes
ask for (playground_constraints)."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.models import AbstractBaseUser

from portal.gateway import validation
from portal.gateway.errors import GatewayError, model_not_found, tenant_suspended
from portal.gateway.services import CHAT, Caller, Completion, completion_stream, models_list
from portal.rollouts.models import Feedback
from portal.rollouts.services import feedback_record
from portal.tenants.models import Tenant

# The name the playground gives the schema in response_format (OpenAI requires one).
SCHEMA_NAME = "playground_schema"
TOOL_CHOICES = ("required", "none")
# Columns of a side-by-side chat: one prompt, this many models at most (base, v1, v2...).
MAX_COLUMNS = 3


async def playground_models(*, tenant: Tenant) -> list[dict]:
    """What /v1/models lists for a key of this tenant with no allow-list."""
    return await models_list(caller=Caller(tenant))


async def playground_completion_stream(*, tenant: Tenant, body: dict, request_id: str) -> Completion:
    """A streamed chat completion with the usage chunk, for the session's tenant. Raises
    GatewayError before the first byte; the ledger row is written once, as for /v1."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    return await completion_stream(caller=Caller(tenant), endpoint=CHAT, body=body, request_id=request_id)


def playground_columns(*, model: Any = None, models: Any = None) -> list[Any]:
    """The models a chat message asks for, one per column: `models` (a list of 1..MAX_COLUMNS
    distinct ids) or the single `model` (whatever it is: the pipeline's validation says what is
    wrong with it). A list that is not one of those is a 400 naming `models`; nothing starts."""
    if models is None:
        return [model]
    if not isinstance(models, list) or not models:
        raise GatewayError(400, f"models: must be a list of 1 to {MAX_COLUMNS} model ids", param="models",
                           code="invalid_models")
    if len(models) > MAX_COLUMNS:
        raise GatewayError(400, f"models: at most {MAX_COLUMNS} models side by side, got {len(models)}",
                           param="models", code="invalid_models")
    for item in models:
        if not isinstance(item, str) or not item.strip():
            raise GatewayError(400, "models: each entry must be a non-empty model id", param="models",
                               code="invalid_models")
    repeated = sorted({item for item in models if models.count(item) > 1})
    if repeated:
        raise GatewayError(400, f"models: `{repeated[0]}` is listed twice; compare different models",
                           param="models", code="invalid_models")
    return list(models)


async def playground_columns_check(*, tenant: Tenant, body: dict, models: list[str]) -> None:
    """Refuse a side-by-side chat that some column would refuse before its first byte for a
    reason shared by all or known up front (a suspended tenant, a malformed body, a model the
    tenant cannot use), so that no column starts and none is billed: one error, with the model
    it names. What only a column's own request can tell (its quota, its worker) stays per column."""
    if not tenant.is_active:
        raise tenant_suspended(tenant.slug)
    validation.validate(CHAT, dict(body, model=models[0]))
    known = {entry["id"] for entry in await models_list(caller=Caller(tenant))}
    for model in models:
        if model not in known:
            error = model_not_found(model)
            raise GatewayError(error.status, error.message, type=error.type, param="models", code=error.code)


def playground_feedback(*, tenant: Tenant, user: AbstractBaseUser, completion_id: Any, rating: Any,
                        comment: Any = "") -> Feedback:
    """The member's thumbs up/down on one of the tenant's answers (its completion id), recorded as
    playground feedback (a second rating replaces the first). InvalidInput / CompletionNotFound
    from portal.rollouts.services for a bad rating or an id that is not the tenant's."""
    return feedback_record(tenant=tenant, completion_id=completion_id, rating=rating, comment=comment,
                           source=Feedback.Source.PLAYGROUND, user=user)


def _box_error(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{message}; nothing was sent.", param=param, code="invalid_playground_input")


def _parse_box(text: Any, *, param: str, label: str) -> Any:
    """The JSON in one of the page's text boxes; None when it is empty."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if not isinstance(text, str):
        raise _box_error(param, f"{label} must be sent as the box's text")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _box_error(param, f"{label} is not valid JSON ({exc})") from None


def _tool(item: Any, i: int) -> dict:
    """One entry of the tools box: an OpenAI tool ({"type": "function", "function": {...}}) or the
    bare function definition ({"name", "description"?, "parameters"?}), which gets wrapped."""
    if not isinstance(item, dict):
        raise _box_error("tools", f"Tools[{i}] must be an object, got {type(item).__name__}")
    function = item.get("function") if item.get("type") == "function" else item
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise _box_error("tools", f"Tools[{i}] needs a function name (\"name\": \"...\")")
    return {"type": "function", "function": function}


def playground_constraints(*, json_schema: Any = None, tools: Any = None, tool_choice: Any = None) -> dict:
    """The request fields the page's optional boxes ask for: `response_format` (json_schema) from
    the JSON schema box, `tools` and `tool_choice` (with parallel_tool_calls false when "required")
    from the tools box and select. Each box holds text as typed; what is not JSON of the right
    shape is a 400 naming the box (json_schema, tools, tool_choice) before anything reaches the
    gateway. Whether a schema is one the worker can enforce is the worker's to say (its 400 names
    response_format)."""
    fields: dict = {}
    schema = _parse_box(json_schema, param="json_schema", label="The JSON schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise _box_error("json_schema", "The JSON schema must be a JSON object such as "
                                            f'{{"type": "object", "properties": {{...}}}}, got {type(schema).__name__}')
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": SCHEMA_NAME, "schema": schema, "strict": True}}
    definitions = _parse_box(tools, param="tools", label="Tools")
    if definitions is not None:
        if isinstance(definitions, dict):
            definitions = [definitions]
        if not isinstance(definitions, list) or not definitions:
            raise _box_error("tools", "Tools must be a non-empty JSON list of function definitions")
        choice = tool_choice or TOOL_CHOICES[0]
        if choice not in TOOL_CHOICES:
            raise _box_error("tool_choice", f"Tool choice must be one of {', '.join(TOOL_CHOICES)}")
        fields["tools"] = [_tool(item, i) for i, item in enumerate(definitions)]
        fields["tool_choice"] = choice
        if choice == "required":
            # One call per answer: asked for an array of calls, a small model tends to repeat the
            # call until max_tokens, and one call is what the page shows best.
            fields["parallel_tool_calls"] = False
    return fields

"""The gateway pipeline: the one entry the /v1 views (portal.gateway.views, .asgi) and the
playground (portal.playground) call. Each step is a module of its own:

    auth      api_key_from_authorization: Bearer sk-... → usable ApiKey (401 invalid_api_key,
              403 tenant_suspended); Caller: a tenant and its key (none for a playground session)
    resolve   the model → the base or a ready adapter version (404 model_not_found); models_list
    admit     quotas, from the estimated tokens (429 rate_limit_exceeded; 429 insufficient_quota
              once a monthly token or money budget is spent)
    relay     route to a worker (next worker on failure before the first byte, lazy adapter load)
              → Completion: the JSON answer, or the chunks to relay
    ledger    the usage row and the quota settlement, written exactly once per request
    observe   what /metrics learns of the request: its tenant, its model once resolved

    completion_stream     validate → resolve → admit → relay
    completion_rejected   the ledger row of a request refused before the pipeline
    models_list           what /v1/models shows a caller

Nothing here knows about HTTP responses: errors are GatewayError (OpenAI's shape), streams are
dicts (chunks in OpenAI's shape, with the public model id).
"""

from __future__ import annotations

import asyncio
import uuid

from portal.gateway import observe, validation
from portal.gateway.admit import admit
from portal.gateway.auth import Caller, api_key_from_authorization
from portal.gateway.errors import GatewayError, tenant_suspended, unexpected, without_addresses
from portal.gateway.ledger import Ledger
from portal.gateway.relay import Completion, open_upstream, worker_payload
from portal.gateway.resolve import model_resolve, models_list

__all__ = [
    "CHAT", "COMPLETIONS", "Caller", "Completion", "api_key_from_authorization", "completion_rejected",
    "completion_stream", "models_list", "new_request_id",
]

CHAT = validation.CHAT
COMPLETIONS = validation.COMPLETIONS


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


async def completion_rejected(*, caller: Caller, request_id: str, error: GatewayError) -> None:
    """Write the ledger row of an authenticated request refused before the pipeline (a body
    that is not JSON, too large...)."""
    ledger = Ledger(request_id=request_id, caller=caller, model="", stream=False)
    ledger.fail(status=error.status, message=error.message, code=error.code, type=error.type)
    await ledger.close()


async def completion_stream(*, caller: Caller, endpoint: str, body: dict, request_id: str) -> Completion:
    """Run the pipeline up to the worker's answer. Raises GatewayError (OpenAI shape) for
    anything that stops the request before its first byte; every such request past
    authentication is still written to the ledger once."""
    model = body.get("model") if isinstance(body, dict) and isinstance(body.get("model"), str) else ""
    ledger = Ledger(request_id=request_id, caller=caller, model=model,
                    stream=isinstance(body, dict) and body.get("stream") is True,
                    constrained=validation.constraint_of(body))
    streaming = False
    observe.pipeline_started()
    try:
        if not caller.tenant.is_active:  # a key's tenant was checked at authentication; a session's here
            raise tenant_suspended(caller.tenant.slug)
        validation.validate(endpoint, body)
        target = await model_resolve(caller=caller, model=body["model"], request_id=request_id)
        ledger.model = target.public_id
        observe.model_resolved(target.public_id)
        ledger.version = target.version
        ledger.estimated_prompt_tokens = validation.estimate_prompt_tokens(endpoint, body)
        ledger.admission = await admit(caller=caller, request_id=request_id, endpoint=endpoint, body=body)

        payload = worker_payload(caller=caller, body=body, target=target, stream=ledger.stream)
        ledger.upstream = await open_upstream(endpoint=endpoint, payload=payload, target=target, ledger=ledger)
        completion = Completion(request_id=request_id, model=target.public_id, stream=ledger.stream,
                                include_usage=validation.wants_usage_chunk(body),
                                headers=dict(getattr(ledger.admission, "headers", None) or {}), target=target,
                                ledger=ledger)
        if ledger.stream:
            streaming = True  # from here the chunks() iterator owns the ledger
            completion.arm_watchdog()
            return completion
        await completion.read()
        return completion
    except GatewayError as exc:
        ledger.fail(status=exc.status, message=exc.message, code=exc.code, type=exc.type)
        raise
    except asyncio.CancelledError:
        ledger.client_disconnected = True
        ledger.status_code = 499
        raise
    except Exception as exc:  # noqa: BLE001 -- the database or Redis failed us: 503 / 500, in JSON
        error = unexpected(exc, request_id=request_id)
        ledger.fail(status=error.status, message=without_addresses(f"{error.message} ({type(exc).__name__}: {exc})"),
                    code=error.code, type=error.type)  # tenants read the message
        raise error from exc
    finally:
        if not streaming:
            await ledger.close()

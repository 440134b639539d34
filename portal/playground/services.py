"""The playground's entry into the gateway pipeline for a tenant authenticated by its session:
the same validation, model resolution, quotas, routing, lazy adapter load and usage ledger as
/v1 (portal.gateway.services), for a Caller with no API key."""

from __future__ import annotations

from portal.gateway.services import CHAT, Caller, Completion, completion_stream, models_list
from portal.tenants.models import Tenant


async def playground_models(*, tenant: Tenant) -> list[dict]:
    """What /v1/models lists for a key of this tenant with no allow-list."""
    return await models_list(caller=Caller(tenant))


async def playground_completion_stream(*, tenant: Tenant, body: dict, request_id: str) -> Completion:
    """A streamed chat completion with the usage chunk, for the session's tenant. Raises
    GatewayError before the first byte; the ledger row is written once, as for /v1."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    return await completion_stream(caller=Caller(tenant), endpoint=CHAT, body=body, request_id=request_id)

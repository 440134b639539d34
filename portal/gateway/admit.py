"""Quota admission: what a request may cost (its estimated tokens) against the tenant's and the
key's limits, before it reaches a worker. A refusal is OpenAI's 429, with Retry-After and, when
waiting cannot help, x-should-retry: false."""

from __future__ import annotations

from portal.core.db import db_sync_to_async
from portal.core.metrics import QUOTA_REJECTIONS
from portal.gateway import cache, validation
from portal.gateway.auth import Caller
from portal.gateway.errors import GatewayError
from portal.quotas.limits import MONTHLY_LIMITS, ScopeSpec
from portal.quotas.selectors import quota_scopes
from portal.quotas.services import Admission, QuotaExceeded, quota_admit

# The output bound assumed for the quota estimate when the request sets none.
DEFAULT_MAX_TOKENS_ESTIMATE = 256


async def _scopes(caller: Caller) -> tuple[ScopeSpec, ...]:
    """quota_scopes of the caller, cached (portal.gateway.cache: a Quota, key or tenant write
    invalidates them)."""
    generation = await cache.generation()
    key = (caller.tenant.pk, caller.api_key.pk if caller.api_key is not None else None)
    scopes = cache.QUOTA_SCOPES.get(key, generation)
    if scopes is cache.MISSING:
        scopes = await db_sync_to_async(quota_scopes)(tenant=caller.tenant, api_key=caller.api_key)
        cache.QUOTA_SCOPES.put(key, scopes, generation)
    return scopes


async def admit(*, caller: Caller, request_id: str, endpoint: str, body: dict) -> Admission:
    """The admission to settle once the request ends (portal.quotas), or a 429 GatewayError."""
    estimated = validation.estimate_tokens(endpoint, body, default_max_tokens=DEFAULT_MAX_TOKENS_ESTIMATE)
    try:
        return await quota_admit(tenant=caller.tenant, api_key=caller.api_key, request_id=request_id,
                                 estimated_tokens=estimated, scopes=await _scopes(caller))
    except QuotaExceeded as exc:
        QUOTA_REJECTIONS.labels(tenant=caller.tenant.slug, limit=exc.limit).inc()
        headers = dict(getattr(exc, "headers", None) or {})
        headers["retry-after"] = str(max(1, int(exc.retry_after or 1)))
        if not exc.should_retry:
            headers["x-should-retry"] = "false"
        if exc.limit in MONTHLY_LIMITS:
            # The month's allowance (tokens or money) is spent: OpenAI's insufficient_quota.
            raise GatewayError(429, exc.message, type="insufficient_quota", code="insufficient_quota",
                               headers=headers) from None
        kind = "tokens" if "token" in str(exc.limit) else "requests"
        raise GatewayError(429, exc.message, type=kind, code="rate_limit_exceeded", headers=headers) from None

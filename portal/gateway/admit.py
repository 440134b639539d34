"""Quota admission: what a request may cost (its estimated tokens) against the tenant's and the
key's limits, before it reaches a worker. A refusal is OpenAI's 429, with Retry-After and, when
waiting cannot help, x-should-retry: false."""

from __future__ import annotations

from portal.core.metrics import QUOTA_REJECTIONS
from portal.gateway import validation
from portal.gateway.auth import Caller
from portal.gateway.errors import GatewayError
from portal.quotas.limits import MONTHLY_LIMITS
from portal.quotas.services import Admission, QuotaExceeded, quota_admit

# The output bound assumed for the quota estimate when the request sets none.
DEFAULT_MAX_TOKENS_ESTIMATE = 256


async def admit(*, caller: Caller, request_id: str, endpoint: str, body: dict) -> Admission:
    """The admission to settle once the request ends (portal.quotas), or a 429 GatewayError."""
    estimated = validation.estimate_tokens(endpoint, body, default_max_tokens=DEFAULT_MAX_TOKENS_ESTIMATE)
    try:
        return await quota_admit(tenant=caller.tenant, api_key=caller.api_key, request_id=request_id,
                                 estimated_tokens=estimated)
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

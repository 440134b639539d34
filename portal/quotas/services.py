"""Quota admission for the gateway: take before forwarding a request, settle after it ends.

    admission = await quota_admit(tenant=t, api_key=k, request_id=rid, estimated_tokens=n)
    try:
        ...forward, relay...
    finally:
        await quota_settle(admission=admission, prompt_tokens=p, completion_tokens=c)

quota_admit raises QuotaExceeded (nothing taken) when any limit of the tenant or of the key
would be broken; its .headers are the full set for the 429 response.

Money (monthly_spend_limit, USD) is priced from the tenant's plan like the monthly statement
(portal.usage.billing.token_cost): at admission the estimate at the dearer of the two prices,
at settlement the exact cost of the prompt and completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

from django.db import transaction

from portal.core.db import db_sync_to_async
from portal.core.exceptions import InvalidInput, full_clean_or_raise
from portal.keys.models import ApiKey
from portal.quotas.backends import get_backend
from portal.quotas.limits import (
    MAX_CONCURRENT_REQUESTS,
    MONTHLY_SPEND_LIMIT,
    MONTHLY_TOKEN_BUDGET,
    REQUESTS_PER_MINUTE,
    TOKENS_PER_MINUTE,
    WINDOW_MS,
    Clock,
    Refusal,
    ScopeSpec,
    ScopeState,
    SettleTicket,
    format_duration,
    retry_after_seconds,
    spend_amount,
    spend_units,
)
from portal.quotas.models import LIMIT_FIELDS, Quota
from portal.quotas.selectors import quota_scopes, quota_usage, tenant_prefix
from portal.tenants.models import Tenant
from portal.tenants.plans import CURRENCY, plan_for
from portal.usage.billing import token_cost

__all__ = [
    "Admission",
    "QuotaExceeded",
    "quota_admit",
    "quota_set",
    "quota_settle",
    "quota_usage",
]

MAX_REQUEST_ID_LENGTH = 200


@dataclass(frozen=True)
class Admission:
    """A request let through; hand it back to quota_settle exactly when the request is over."""

    request_id: str
    tenant_id: int
    api_key_id: int | None
    estimated_tokens: int
    headers: dict[str, str]  # x-ratelimit-* for the response
    ticket: SettleTicket = field(repr=False)
    # USD per 1M prompt and completion tokens at admission: settlement prices with these
    prices: tuple[Decimal, Decimal] = (Decimal(0), Decimal(0))


class QuotaExceeded(Exception):
    """A limit would be broken; nothing was taken. Map to 429: rate_limit_exceeded, or
    insufficient_quota for a monthly limit (limits.MONTHLY_LIMITS)."""

    def __init__(
        self,
        *,
        limit: str,
        scope: str,
        message: str,
        retry_after: int,
        should_retry: bool,
        headers: dict[str, str],
    ):
        super().__init__(message)
        self.limit = limit  # "requests_per_minute" | "tokens_per_minute" | ...
        self.scope = scope  # "tenant" | "key"
        self.message = message
        self.retry_after = retry_after  # seconds
        self.should_retry = should_retry  # False: the SDK must not retry (x-should-retry: false)
        self.headers = headers  # x-ratelimit-*, retry-after and, when final, x-should-retry


async def quota_admit(
    *, tenant: Tenant, api_key: ApiKey | None, request_id: str, estimated_tokens: int,
    scopes: tuple[ScopeSpec, ...] | None = None,
) -> Admission:
    """Check and take every limit of the tenant and the key at once, or raise QuotaExceeded.

    estimated_tokens: prompt tokens plus the most the completion may take (max_tokens);
    quota_settle replaces it with the real count. scopes: quota_scopes(tenant, api_key) when the
    caller has them already (the gateway caches them); read here otherwise.
    """
    _check_request_id(request_id)
    _check_count("estimated_tokens", estimated_tokens)
    if scopes is None:
        scopes = await db_sync_to_async(quota_scopes)(tenant=tenant, api_key=api_key)
    clock = Clock.now()
    plan = plan_for(tenant.plan)
    prices = (plan.prompt_price_per_million, plan.completion_price_per_million)
    estimated_spend = spend_units(token_cost(estimated_tokens, max(prices)))
    outcome = await get_backend().admit(
        scopes=scopes, request_id=request_id, estimated_tokens=estimated_tokens, clock=clock,
        estimated_spend=estimated_spend,
    )
    headers = ratelimit_headers(scopes=scopes, states=outcome.states, clock=clock)
    if outcome.refusal is not None:
        raise _exceeded(
            refusal=outcome.refusal,
            scopes=scopes,
            states=outcome.states,
            estimated_tokens=estimated_tokens,
            estimated_spend=estimated_spend,
            headers=headers,
            clock=clock,
        )
    return Admission(
        request_id=request_id,
        tenant_id=tenant.pk,
        api_key_id=api_key.pk if api_key is not None else None,
        estimated_tokens=estimated_tokens,
        headers=headers,
        ticket=SettleTicket(
            request_id=request_id,
            settled_key=f"{tenant_prefix(tenant.pk)}:settled:{request_id}",
            estimated_tokens=estimated_tokens,
            month=clock.month,
            scopes=tuple(
                (scope.prefix, state.window_start_ms)
                for scope, state in zip(scopes, outcome.states, strict=True)
            ),
            estimated_spend=estimated_spend,
        ),
        prices=prices,
    )


async def quota_settle(*, admission: Admission, prompt_tokens: int, completion_tokens: int) -> bool:
    """Replace the estimate with the actual tokens and free the concurrency slot.

    Idempotent: only the first call for an admission counts (True); later ones return False.
    Call it however the request ended (failed before any token: 0 and 0).
    """
    _check_count("prompt_tokens", prompt_tokens)
    _check_count("completion_tokens", completion_tokens)
    prompt_price, completion_price = admission.prices
    return await get_backend().settle(
        ticket=admission.ticket,
        actual_tokens=prompt_tokens + completion_tokens,
        clock=Clock.now(),
        actual_spend=spend_units(token_cost(prompt_tokens, prompt_price) + token_cost(completion_tokens, completion_price)),
    )


@transaction.atomic
def quota_set(*, tenant: Tenant | None = None, api_key: ApiKey | None = None, **limits) -> Quota:
    """Create or replace the Quota row of a tenant or a key (limits not given become null)."""
    if (tenant is None) == (api_key is None):
        raise InvalidInput("quota", "give exactly one of tenant and api_key")
    unknown = set(limits) - set(LIMIT_FIELDS)
    if unknown:
        raise InvalidInput(sorted(unknown)[0], f"not a quota limit (one of {', '.join(LIMIT_FIELDS)})")
    quota = Quota.objects.select_for_update().filter(tenant=tenant, api_key=api_key).first()
    quota = quota or Quota(tenant=tenant, api_key=api_key)
    for name in LIMIT_FIELDS:
        value = limits.get(name)
        if value is not None and name == MONTHLY_SPEND_LIMIT:
            value = _check_amount(name, value)
        elif value is not None:
            _check_count(name, value)
        setattr(quota, name, value)
    full_clean_or_raise(quota)
    quota.save()
    return quota


def ratelimit_headers(
    *, scopes: tuple[ScopeSpec, ...], states: tuple[ScopeState, ...], clock: Clock
) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers from the tightest scope for requests and for tokens.

    A dimension no scope limits gets no headers.
    """
    headers = {}
    for dimension, limit_name, used_name in (
        ("requests", "requests_per_minute", "requests"),
        ("tokens", "tokens_per_minute", "tokens"),
    ):
        tightest = None
        for scope, state in zip(scopes, states, strict=True):
            limit = getattr(scope, limit_name)
            if limit is None:
                continue
            remaining = max(0, limit - getattr(state, used_name))
            reset_ms = state.window_start_ms + WINDOW_MS - clock.now_ms
            if getattr(state, used_name) == 0:
                reset_ms = 0  # nothing taken in this window: already at its initial state
            if tightest is None or remaining < tightest[1]:
                tightest = (limit, remaining, reset_ms)
        if tightest is not None:
            limit, remaining, reset_ms = tightest
            headers[f"x-ratelimit-limit-{dimension}"] = str(limit)
            headers[f"x-ratelimit-remaining-{dimension}"] = str(remaining)
            headers[f"x-ratelimit-reset-{dimension}"] = format_duration(reset_ms)
    return headers


def _exceeded(
    *,
    refusal: Refusal,
    scopes: tuple[ScopeSpec, ...],
    states: tuple[ScopeState, ...],
    estimated_tokens: int,
    estimated_spend: int,
    headers: dict[str, str],
    clock: Clock,
) -> QuotaExceeded:
    scope, state = scopes[refusal.scope_index], states[refusal.scope_index]
    limit = getattr(scope, refusal.limit)
    wait = format_duration(refusal.retry_after_ms)
    if refusal.limit == REQUESTS_PER_MINUTE:
        message = (
            f"Rate limit reached for {scope.label} on requests per minute: limit {limit}, "
            f"used {state.requests}, requested 1. Please try again in {wait}."
        )
    elif refusal.limit == TOKENS_PER_MINUTE and refusal.final:
        message = (
            f"Request too large for {scope.label} on tokens per minute: limit {limit}, "
            f"requested {estimated_tokens}. The limit resets every minute (next in {wait}), but "
            "this request alone is over it: shorten the prompt or lower max_tokens."
        )
    elif refusal.limit == TOKENS_PER_MINUTE:
        message = (
            f"Rate limit reached for {scope.label} on tokens per minute: limit {limit}, "
            f"used {state.tokens}, requested {estimated_tokens}. Please try again in {wait}."
        )
    elif refusal.limit == MAX_CONCURRENT_REQUESTS:
        message = (
            f"Too many concurrent requests for {scope.label}: limit {limit} in flight, "
            f"{state.in_flight} running. Please try again in {wait}, when one has finished."
        )
    elif refusal.limit == MONTHLY_SPEND_LIMIT:
        message = (
            f"You exceeded your current quota: the monthly spend limit of {scope.label} is "
            f"{_usd(limit)} {CURRENCY}, {_usd(spend_amount(state.month_spend))} {CURRENCY} is spent "
            f"and this request may cost up to {_usd(spend_amount(estimated_spend))} {CURRENCY}. "
            f"The limit resets at {clock.next_month.strftime('%Y-%m-%dT%H:%M:%SZ')}."
        )
    else:
        assert refusal.limit == MONTHLY_TOKEN_BUDGET
        message = (
            f"Monthly token budget exhausted for {scope.label}: limit {limit}, used "
            f"{state.month_tokens}, requested {estimated_tokens}. The budget resets at "
            f"{clock.next_month.strftime('%Y-%m-%dT%H:%M:%SZ')}."
        )
    retry_after = retry_after_seconds(refusal.retry_after_ms)
    headers = {**headers, "retry-after": str(retry_after)}
    if refusal.final:
        headers["x-should-retry"] = "false"
    return QuotaExceeded(
        limit=refusal.limit,
        scope=scope.scope,
        message=message,
        retry_after=retry_after,
        should_retry=not refusal.final,
        headers=headers,
    )


def _check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH:
        raise InvalidInput("request_id", f"must be 1-{MAX_REQUEST_ID_LENGTH} characters")


def _usd(amount: Decimal) -> str:
    """An amount with at least cents and at most micro-USD, trailing zeros dropped past cents."""
    text = f"{Decimal(amount).quantize(Decimal('0.000001')):f}".rstrip("0")
    whole, _, fraction = text.partition(".")
    return f"{whole}.{fraction.ljust(2, '0')}"


def _check_amount(name: str, value) -> Decimal:
    """A money limit: a Decimal, int or numeric string >= 0 (floats are refused: 0.1 is not exact)."""
    if isinstance(value, bool) or not isinstance(value, Decimal | int | str):
        raise InvalidInput(name, f"must be an amount in {CURRENCY} (a decimal string such as \"25.00\"), got {value!r}")
    try:
        amount = Decimal(value)
    except ArithmeticError:
        raise InvalidInput(name, f"not an amount: {value!r}") from None
    if not amount.is_finite() or amount < 0:
        raise InvalidInput(name, f"must be an amount >= 0, got {value!r}")
    return amount


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(name, f"must be a whole number >= 0, got {value!r}")

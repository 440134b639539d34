"""Reads on quotas: the limits that apply to a request, and current usage for dashboards."""

from __future__ import annotations

from django.db.models import Q

from portal.keys.models import ApiKey
from portal.quotas.backends import get_backend
from portal.quotas.limits import LIMIT_CODES, WINDOW_MS, Clock, ScopeSpec, spend_amount
from portal.quotas.models import LIMIT_FIELDS, Quota
from portal.quotas.runtime import key_prefix
from portal.tenants.models import Tenant
from portal.tenants.plans import CURRENCY, plan_for


def tenant_prefix(tenant_id: int) -> str:
    # The hash tag {t<id>} puts all of a tenant's counters in one Redis Cluster slot.
    return f"{key_prefix()}{{t{tenant_id}}}"


def quota_scopes(*, tenant: Tenant, api_key: ApiKey | None) -> tuple[ScopeSpec, ...]:
    """The limits a request by this tenant (through this key) is checked against.

    The tenant's scope always (its Quota row over its plan, field by field); the key's scope
    only when the key has a Quota row (its null fields are no limit). One query.
    """
    owner = Q(tenant=tenant) | Q(api_key=api_key) if api_key is not None else Q(tenant=tenant)
    rows = list(Quota.objects.filter(owner))
    tenant_row = next((row for row in rows if row.tenant_id == tenant.pk), None)
    key_row = next((row for row in rows if api_key is not None and row.api_key_id == api_key.pk), None)

    plan = plan_for(tenant.plan)
    tenant_limits = {
        name: getattr(tenant_row, name, None) if tenant_row is not None else None
        for name in LIMIT_FIELDS
    }
    scopes = [
        ScopeSpec(
            scope="tenant",
            label=f"tenant '{tenant.slug}'",
            prefix=f"{tenant_prefix(tenant.pk)}:tenant",
            **{
                name: value if value is not None else getattr(plan, name)
                for name, value in tenant_limits.items()
            },
        )
    ]
    if key_row is not None:
        scopes.append(
            ScopeSpec(
                scope="key",
                label=f"API key '{api_key.name}' ({api_key.display_prefix})",
                prefix=f"{tenant_prefix(tenant.pk)}:key:{api_key.pk}",
                **{name: getattr(key_row, name) for name in LIMIT_FIELDS},
            )
        )
    return tuple(scopes)


def quota_usage(*, tenant: Tenant, api_key: ApiKey | None = None) -> dict:
    """Current counters against limits, for dashboards (the key's own when it has a Quota row).

    {"scope": "tenant", "requests_per_minute": {"used", "limit", "resets_in_seconds"},
     "tokens_per_minute": {...}, "max_concurrent_requests": {"used", "limit"},
     "monthly_token_budget": {"used", "limit", "month", "resets_at"},
     "monthly_spend_limit": {"used", "limit" (Decimal USD), "currency", "month", "resets_at"}};
    limit None = unlimited.
    """
    clock = Clock.now()
    scopes = quota_scopes(tenant=tenant, api_key=api_key)
    scope = scopes[-1] if api_key is not None else scopes[0]
    state = get_backend().snapshot(scope=scope, clock=clock)
    resets_in = max(0, state.window_start_ms + WINDOW_MS - clock.now_ms) / 1000 if state.requests else 0
    rpm, tpm, concurrent, budget, spend = LIMIT_CODES
    return {
        "scope": scope.scope,
        rpm: {"used": state.requests, "limit": scope.requests_per_minute, "resets_in_seconds": resets_in},
        tpm: {"used": state.tokens, "limit": scope.tokens_per_minute, "resets_in_seconds": resets_in},
        concurrent: {"used": state.in_flight, "limit": scope.max_concurrent_requests},
        budget: {
            "used": state.month_tokens,
            "limit": scope.monthly_token_budget,
            "month": clock.month,
            "resets_at": clock.next_month.isoformat(),
        },
        spend: {
            "used": spend_amount(state.month_spend),
            "limit": scope.monthly_spend_limit,
            "currency": CURRENCY,
            "month": clock.month,
            "resets_at": clock.next_month.isoformat(),
        },
    }

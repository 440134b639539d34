"""What each plan gives a tenant: default quotas and token prices.

One table, read by quotas (limits when a tenant or key has no explicit Quota row), by
billing (prices per million tokens) and by the gateway (the tenant's scheduling weight). None means unlimited.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

CURRENCY = "USD"  # of every price and money limit below


@dataclass(frozen=True)
class Plan:
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    monthly_token_budget: int | None
    prompt_price_per_million: Decimal  # USD per 1M prompt tokens
    completion_price_per_million: Decimal  # USD per 1M completion tokens
    always_warm_adapters: int  # adapters the tenant may pin on the workers
    scheduling_weight: float  # the tenant's share in the workers' fair scheduling (tenant_weight)
    monthly_spend_limit: Decimal | None = None  # USD a month, priced like the statement; None: no limit
    # The TTFT objective: p95 time to first token (ms) the tenant's requests should stay within;
    # Tenant.ttft_p95_target_ms overrides it. Paying more buys a tighter objective.
    ttft_p95_target_ms: int = 2000


PLANS: dict[str, Plan] = {
    "free": Plan(60, 40_000, 4, 2_000_000, Decimal("0.10"), Decimal("0.30"), 0, 1.0, ttft_p95_target_ms=2000),
    "team": Plan(600, 400_000, 32, 200_000_000, Decimal("0.08"), Decimal("0.24"), 2, 2.0, ttft_p95_target_ms=1000),
    "enterprise": Plan(None, None, 256, None, Decimal("0.05"), Decimal("0.15"), 16, 4.0, ttft_p95_target_ms=500),
}


def ttft_target(*, plan: str, override_ms: int | None) -> tuple[int, str]:
    """A tenant's TTFT p95 objective in ms and where it comes from ("tenant" or "plan")."""
    if override_ms is not None:
        return override_ms, "tenant"
    return plan_for(plan).ttft_p95_target_ms, "plan"


def plan_for(name: str) -> Plan:
    """The plan named `name` (a Tenant.Plan value); unknown names get the free plan's terms."""
    return PLANS.get(name, PLANS["free"])

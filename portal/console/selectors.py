"""Reads the portal pages need that are not already a selector elsewhere: this month at a glance,
usage series that include today (the daily rollups run hourly, so today comes from the ledger),
the months a tenant can open a statement for."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from decimal import Decimal

from django.db.models import Count, Q, Sum

from portal.quotas.selectors import quota_usage
from portal.tenants.models import Tenant
from portal.usage.billing import statement_for
from portal.usage.models import ERROR_Q, UsageRecord
from portal.usage.periods import day_bounds, month_bounds
from portal.usage.selectors import usage_by_day, usage_by_model

MAX_DAYS = 366


@dataclass(frozen=True)
class MonthOverview:
    period: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    spend: Decimal
    budget_tokens: int | None  # None: unlimited
    budget_used_tokens: int
    spend_limit: Decimal | None = None  # USD a month; None: no limit
    spend_used: Decimal = Decimal(0)  # what admission counts against spend_limit

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def budget_percent(self) -> int | None:
        if not self.budget_tokens:
            return None
        return min(100, round(100 * self.budget_used_tokens / self.budget_tokens))

    @property
    def spend_percent(self) -> int | None:
        if self.spend_limit is None:
            return None
        if not self.spend_limit:
            return 100
        return min(100, round(100 * self.spend_used / self.spend_limit))


def month_overview(*, tenant: Tenant, now: datetime) -> MonthOverview:
    """Requests, tokens and spend of the current UTC month (the live ledger, priced like the
    statement) against the monthly token budget (the quota counters, as admission sees them)."""
    now = now.astimezone(UTC)
    statement = statement_for(tenant=tenant, year=now.year, month=now.month)
    start, end = month_bounds(now.year, now.month)
    # Every request, refused ones too (the statement leaves out those that used no token).
    counts = UsageRecord.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end).aggregate(
        requests=Count("id"), errors=Count("id", filter=ERROR_Q))
    usage = quota_usage(tenant=tenant)
    budget, spend_limit = usage["monthly_token_budget"], usage["monthly_spend_limit"]
    return MonthOverview(
        period=statement.period,
        requests=counts["requests"],
        errors=counts["errors"],
        prompt_tokens=statement.prompt_tokens,
        completion_tokens=statement.completion_tokens,
        spend=statement.total_cost,
        budget_tokens=budget["limit"],
        budget_used_tokens=max(int(budget["used"] or 0), statement.total_tokens),
        spend_limit=spend_limit["limit"],
        spend_used=max(spend_limit["used"], statement.total_cost),
    )


def _ledger_today(*, tenant: Tenant, today: date, by_model: bool) -> list[dict]:
    start, end = day_bounds(today)
    records = UsageRecord.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end)
    if by_model:
        records = records.values("model").order_by("model")
    rows = records.annotate(
        _requests=Count("id"),
        _errors=Count("id", filter=ERROR_Q),
        _disconnects=Count("id", filter=Q(client_disconnected=True)),
        _prompt=Sum("prompt_tokens"),
        _completion=Sum("completion_tokens"),
    ) if by_model else [records.aggregate(
        _requests=Count("id"),
        _errors=Count("id", filter=ERROR_Q),
        _disconnects=Count("id", filter=Q(client_disconnected=True)),
        _prompt=Sum("prompt_tokens"),
        _completion=Sum("completion_tokens"),
    )]
    result = []
    for row in rows:
        prompt, completion = row["_prompt"] or 0, row["_completion"] or 0
        item = {
            "requests": row["_requests"], "errors": row["_errors"], "disconnects": row["_disconnects"],
            "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        }
        if by_model:
            item["model"] = row["model"]
        result.append(item)
    return result


def usage_days(*, tenant: Tenant, start: date, end: date, today: date) -> list[dict]:
    """usage_by_day over [start, end] with today's row (if in range) read from the ledger."""
    rows = usage_by_day(tenant=tenant, start=start, end=end)
    if start <= today <= end:
        live = _ledger_today(tenant=tenant, today=today, by_model=False)[0]
        rows = [{**row, **live} if row["date"] == today else row for row in rows]
    return rows


def usage_models(*, tenant: Tenant, start: date, end: date, today: date) -> list[dict]:
    """usage_by_model over [start, end], today's part read from the ledger; most tokens first."""
    totals: dict[str, dict] = {}
    if start < today or end < today:
        for row in usage_by_model(tenant=tenant, start=start, end=min(end, today - timedelta(days=1))):
            totals[row["model"]] = dict(row)
    if start <= today <= end:
        for row in _ledger_today(tenant=tenant, today=today, by_model=True):
            current = totals.setdefault(row["model"], {"model": row["model"]})
            for key, value in row.items():
                if key != "model":
                    current[key] = current.get(key, 0) + value
    return sorted(totals.values(), key=lambda row: (-row["total_tokens"], row["model"]))


def statement_months(*, tenant: Tenant, now: datetime, limit: int = 24) -> list[tuple[int, int]]:
    """(year, month) from the current UTC month back to the tenant's first, newest first."""
    now = now.astimezone(UTC)
    first = tenant.created_at.astimezone(UTC) if tenant.created_at else now
    first_record = UsageRecord.objects.filter(tenant=tenant).order_by("created_at").values_list(
        "created_at", flat=True).first()
    if first_record is not None and first_record < first:
        first = first_record.astimezone(UTC)
    months = []
    year, month = now.year, now.month
    while (year, month) >= (first.year, first.month) and len(months) < limit:
        months.append((year, month))
        year, month = (year - 1, 12) if month == 1 else (year, month - 1)
    return months

"""Reads on usage for dashboards and exports. Dates are UTC days, `start` and `end` both included."""

from __future__ import annotations

from datetime import date, timedelta

from django.db.models import Count, QuerySet, Sum

from portal.tenants.models import Tenant
from portal.usage.models import COMPLETED_Q, DailyUsage, UsageRecord
from portal.usage.percentiles import (
    PERCENTILES,
    PercentileCont,
    database_has_percentile_cont,
    percentile_cont,
)
from portal.usage.periods import days_bounds

_SUMS = {
    "requests": Sum("requests"),
    "errors": Sum("errors"),
    "disconnects": Sum("disconnects"),
    "prompt_tokens": Sum("prompt_tokens"),
    "completion_tokens": Sum("completion_tokens"),
}


def usage_record_list(
    *, tenant: Tenant, start: date | None = None, end: date | None = None
) -> QuerySet[UsageRecord]:
    """The tenant's ledger, oldest first, optionally limited to days [start, end]."""
    records = UsageRecord.objects.filter(tenant=tenant)
    if start is not None and end is not None:
        days_bounds(start, end)  # validates the order
    if start is not None:
        records = records.filter(created_at__gte=days_bounds(start, start)[0])
    if end is not None:
        records = records.filter(created_at__lt=days_bounds(end, end)[1])
    return records.order_by("created_at", "id")


def usage_by_day(*, tenant: Tenant, start: date, end: date, model: str | None = None) -> list[dict]:
    """One dict per day in [start, end], days without use included as zeros (from the rollups).

    Keys: date, requests, errors, disconnects, prompt_tokens, completion_tokens, total_tokens.
    """
    days_bounds(start, end)  # validates the order
    rows = DailyUsage.objects.filter(tenant=tenant, date__gte=start, date__lte=end)
    if model is not None:
        rows = rows.filter(model=model)
    by_date = {row["date"]: row for row in rows.values("date").annotate(**_SUMS).order_by("date")}
    result = []
    day = start
    while day <= end:
        row = by_date.get(day, {})
        counts = {name: row.get(name) or 0 for name in _SUMS}
        result.append({"date": day, **counts, "total_tokens": counts["prompt_tokens"] + counts["completion_tokens"]})
        day += timedelta(days=1)
    return result


def usage_by_model(*, tenant: Tenant, start: date, end: date) -> list[dict]:
    """One dict per model used in [start, end] (from the rollups), most tokens first.

    Keys: model, requests, errors, disconnects, prompt_tokens, completion_tokens, total_tokens.
    """
    days_bounds(start, end)
    rows = (
        DailyUsage.objects.filter(tenant=tenant, date__gte=start, date__lte=end)
        .values("model")
        .annotate(**_SUMS)
        .order_by("model")
    )
    result = [{**row, "total_tokens": row["prompt_tokens"] + row["completion_tokens"]} for row in rows]
    return sorted(result, key=lambda row: -row["total_tokens"])


def latency_percentiles(
    *, tenant: Tenant, start: date, end: date, model: str | None = None
) -> dict[str, dict[str, float | None] | int]:
    """TTFT and latency percentiles (ms) over completed requests in [start, end], from the ledger.

    {"requests": n, "ttft_ms": {"p50": .., "p95": .., "p99": ..}, "latency_ms": {...}};
    percentiles are None when nothing completed.
    """
    lower, upper = days_bounds(start, end)
    records = UsageRecord.objects.filter(
        COMPLETED_Q, tenant=tenant, created_at__gte=lower, created_at__lt=upper
    )
    if model is not None:
        records = records.filter(model=model)
    columns = {"ttft_ms": "time_to_first_token_ms", "latency_ms": "latency_ms"}
    names = {f"p{round(p * 100)}": p for p in PERCENTILES}
    if database_has_percentile_cont():
        row = records.aggregate(
            requests=Count("id"),
            **{
                f"{metric}__{name}": PercentileCont(column, p)
                for metric, column in columns.items()
                for name, p in names.items()
            },
        )
        result: dict = {"requests": row["requests"]}
        for metric in columns:
            result[metric] = {name: row[f"{metric}__{name}"] for name in names}
        return result
    values = list(records.values_list("time_to_first_token_ms", "latency_ms"))
    result = {"requests": len(values)}
    for index, metric in enumerate(columns):
        column_values = [row[index] for row in values]
        result[metric] = {name: percentile_cont(column_values, p) for name, p in names.items()}
    return result

"""Writes on the usage ledger: one UsageRecord per request, and the daily rollups."""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from datetime import date, datetime, timedelta

from django.db import transaction
from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from portal.adapters.models import AdapterVersion
from portal.core.exceptions import InvalidInput
from portal.keys.models import ApiKey
from portal.tenants.models import Tenant
from portal.usage.models import (
    COMPLETED_Q,
    ERROR_CODE_MAX_LENGTH,
    ERROR_Q,
    FINISH_REASON_MAX_LENGTH,
    MODEL_MAX_LENGTH,
    REQUEST_ID_MAX_LENGTH,
    WORKER_URL_MAX_LENGTH,
    DailyUsage,
    UsageRecord,
)
from portal.usage.percentiles import (
    PERCENTILES,
    PercentileCont,
    database_has_percentile_cont,
    percentile_cont,
)
from portal.usage.periods import day_bounds, utc_today

logger = logging.getLogger(__name__)
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def usage_record_create(
    *,
    request_id: str,
    tenant: Tenant,
    model: str,
    api_key: ApiKey | None = None,
    adapter_version: AdapterVersion | None = None,
    worker_url: str | None = "",
    stream: bool = False,
    prompt_tokens: int = 0,
    completion_tokens: int = 0,
    cached_prompt_tokens: int = 0,
    constrained: str = "",
    completion_id: str | None = "",
    adapter_tier: str = "",
    time_to_first_token_ms: float | None = None,
    inter_token_ms: float | None = None,
    queue_ms: float | None = None,
    latency_ms: float = 0.0,
    finish_reason: str | None = "",
    error: str | None = "",
    error_code: str | None = "",
    status_code: int = 200,
    client_disconnected: bool = False,
    upstream_attempts: int = 0,
    created_at: datetime | None = None,
    finished_at: datetime | None = None,
) -> UsageRecord:
    """Record one request, exactly once per request_id.

    INSERT ... ON CONFLICT DO NOTHING, then read the row back: whoever calls first (or wins
    the race, from any number of threads or processes) writes it, every later call gets
    that same row back unchanged. Strings longer than their columns are cut rather than
    refused, and characters the database cannot store are replaced (storable_text), so a request
    with an outlandish model id still leaves its row in the ledger.
    """
    if not isinstance(request_id, str) or not request_id.strip():
        raise InvalidInput("request_id", "must be a non-empty string")
    if len(request_id) > REQUEST_ID_MAX_LENGTH:
        raise InvalidInput("request_id", f"longer than {REQUEST_ID_MAX_LENGTH} characters")
    for field, value in (("prompt_tokens", prompt_tokens), ("completion_tokens", completion_tokens),
                         ("cached_prompt_tokens", cached_prompt_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidInput(field, f"must be a non-negative integer, got {value!r}")
    if cached_prompt_tokens > prompt_tokens:
        raise InvalidInput("cached_prompt_tokens", f"{cached_prompt_tokens} is more than prompt_tokens ({prompt_tokens})")
    if constrained not in UsageRecord.Constrained.values:
        raise InvalidInput("constrained", f"must be one of {UsageRecord.Constrained.values}, got {constrained!r}")
    if adapter_tier not in UsageRecord.AdapterTier.values:
        raise InvalidInput("adapter_tier", f"must be one of {UsageRecord.AdapterTier.values}, got {adapter_tier!r}")
    for field, value in (("inter_token_ms", inter_token_ms), ("queue_ms", queue_ms)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not 0 <= value < float("inf")):
            raise InvalidInput(field, f"must be a non-negative number of milliseconds or None, got {value!r}")
    if isinstance(upstream_attempts, bool) or not isinstance(upstream_attempts, int) or not 0 <= upstream_attempts < 2**15:
        raise InvalidInput("upstream_attempts", f"must be a non-negative integer, got {upstream_attempts!r}")
    if api_key is not None and api_key.tenant_id != tenant.pk:
        raise InvalidInput("api_key", f"belongs to another tenant than {tenant}")
    now = timezone.now()
    created_at = created_at or now
    finished_at = finished_at or now
    for field, value in (("created_at", created_at), ("finished_at", finished_at)):
        if timezone.is_naive(value):
            raise InvalidInput(field, "must carry a time zone")

    record = UsageRecord(
        request_id=request_id,
        tenant=tenant,
        api_key=api_key,
        model=storable_text(model, MODEL_MAX_LENGTH),
        adapter_version=adapter_version,
        worker_url=storable_text(worker_url, WORKER_URL_MAX_LENGTH),
        stream=stream,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        cached_prompt_tokens=cached_prompt_tokens,
        constrained=constrained,
        completion_id=storable_text(completion_id, REQUEST_ID_MAX_LENGTH),
        adapter_tier=adapter_tier,
        time_to_first_token_ms=time_to_first_token_ms,
        inter_token_ms=inter_token_ms,
        queue_ms=queue_ms,
        latency_ms=latency_ms,
        finish_reason=storable_text(finish_reason, FINISH_REASON_MAX_LENGTH),
        error=storable_text(error),
        error_code=storable_text(error_code, ERROR_CODE_MAX_LENGTH),
        status_code=status_code,
        client_disconnected=client_disconnected,
        upstream_attempts=upstream_attempts,
        created_at=created_at,
        finished_at=finished_at,
    )
    UsageRecord.objects.bulk_create([record], ignore_conflicts=True)
    stored = UsageRecord.objects.get(request_id=request_id)
    if stored.tenant_id != tenant.pk:
        # The id was already used by another tenant's request: a gateway bug, never silent.
        logger.error("usage record %s exists for tenant %s, not %s", request_id, stored.tenant_id, tenant.pk)
    return stored


def storable_text(value: str | None, max_length: int | None = None) -> str:
    """What a client sent, made storable: PostgreSQL text refuses NUL, UTF-8 refuses lone
    surrogates (a JSON body may carry "\\u0000" or "\\ud800"); each becomes U+FFFD."""
    text = _UNSTORABLE.sub("\ufffd", value or "")
    return text[:max_length] if max_length is not None else text


@transaction.atomic
def usage_rollup_day(*, day: date) -> int:
    """Rebuild DailyUsage for one UTC day from the ledger; returns the number of rows.

    Idempotent: rows are upserted on (date, tenant, model) and rows for groups no longer in
    the ledger are removed, so running it twice, or concurrently, gives the same rows.
    """
    start, end = day_bounds(day)
    records = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end)
    groups = list(
        records.values("tenant_id", "model")
        .annotate(
            requests=Count("id"),
            errors=Count("id", filter=ERROR_Q),
            disconnects=Count("id", filter=Q(client_disconnected=True)),
            prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens"),
            versions=Count("adapter_version_id", distinct=True),
            version=Max("adapter_version_id"),
        )
        .order_by("tenant_id", "model")
    )
    percentiles = _day_percentiles(records)

    rows = []
    for group in groups:
        key = (group["tenant_id"], group["model"])
        rows.append(
            DailyUsage(
                date=day,
                tenant_id=group["tenant_id"],
                model=group["model"],
                adapter_version_id=group["version"] if group["versions"] == 1 else None,
                requests=group["requests"],
                errors=group["errors"],
                disconnects=group["disconnects"],
                prompt_tokens=group["prompt_tokens"] or 0,
                completion_tokens=group["completion_tokens"] or 0,
                **percentiles.get(key, {}),
            )
        )
    update_fields = [
        "adapter_version",
        "requests",
        "errors",
        "disconnects",
        "prompt_tokens",
        "completion_tokens",
        *(f"{metric}_p{round(p * 100)}_ms" for metric in ("ttft", "latency") for p in PERCENTILES),
        "updated_at",
    ]
    if rows:
        DailyUsage.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=["date", "tenant", "model"],
            update_fields=update_fields,
        )
    kept = {(group["tenant_id"], group["model"]) for group in groups}
    stale = [
        pk
        for pk, tenant_id, model in DailyUsage.objects.filter(date=day).values_list("pk", "tenant_id", "model")
        if (tenant_id, model) not in kept
    ]
    if stale:
        DailyUsage.objects.filter(pk__in=stale).delete()
    return len(rows)


def _day_percentiles(records) -> dict[tuple[int, str], dict[str, float | None]]:
    """{(tenant_id, model): {"ttft_p50_ms": ..., "latency_p99_ms": ...}} over completed requests."""
    completed = records.filter(COMPLETED_Q)
    fields = {
        f"{metric}_p{round(p * 100)}_ms": (column, p)
        for metric, column in (("ttft", "time_to_first_token_ms"), ("latency", "latency_ms"))
        for p in PERCENTILES
    }
    if database_has_percentile_cont():
        rows = completed.values("tenant_id", "model").annotate(
            **{name: PercentileCont(column, p) for name, (column, p) in fields.items()}
        ).order_by()
        return {(row["tenant_id"], row["model"]): {name: row[name] for name in fields} for row in rows}

    values: dict[tuple[int, str], dict[str, list[float | None]]] = defaultdict(lambda: defaultdict(list))
    for tenant_id, model, ttft, latency in completed.values_list(
        "tenant_id", "model", "time_to_first_token_ms", "latency_ms"
    ).iterator():
        values[(tenant_id, model)]["time_to_first_token_ms"].append(ttft)
        values[(tenant_id, model)]["latency_ms"].append(latency)
    return {
        key: {name: percentile_cont(columns[column], p) for name, (column, p) in fields.items()}
        for key, columns in values.items()
    }


def usage_rollup_recent(*, now: datetime | None = None) -> list[date]:
    """Roll up yesterday and today (UTC), what the hourly beat task does; returns the days."""
    today = utc_today(now or timezone.now())
    days = [today - timedelta(days=1), today]
    for day in days:
        usage_rollup_day(day=day)
    return days


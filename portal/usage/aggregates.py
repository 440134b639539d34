"""The roll-up aggregate of the ledger, shared by the writes (rollups) and the reads (timeseries).

For one window of buckets: counts, token sums, the SLO tally and exact p50/p95/p99 of each timing
over completed requests, per bucket and, optionally, per group of each dashboard dimension
(GROUP BY GROUPING SETS). aggregate_sql computes it in PostgreSQL (percentile_cont in the
database); aggregate_python gives the same numbers elsewhere (SQLite in `make run`).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from django.db import connection

from portal.core.ranges import EPOCH
from portal.tenants.models import Tenant
from portal.tenants.plans import PLANS, plan_for, ttft_target
from portal.usage.models import UsageRecord, UsageRollup
from portal.usage.percentiles import PERCENTILES, database_has_percentile_cont, percentile_cont

Granularity = UsageRollup.Granularity
Dimension = UsageRollup.Dimension
WIDTHS: dict[str, timedelta] = {
    Granularity.MINUTE: timedelta(minutes=1), Granularity.HOUR: timedelta(hours=1), Granularity.DAY: timedelta(days=1),
}
# Retention (usage_rollup_prune): minute rows serve ranges up to a day, hour rows up to
# ranges.MAX_SPAN (400 days); day rows are kept for ever (they are few: ~100 a day).
RETENTION: dict[str, timedelta | None] = {
    Granularity.MINUTE: timedelta(days=3), Granularity.HOUR: timedelta(days=400), Granularity.DAY: None,
}
# metric name in UsageRollup / the JSON -> (ledger column, which completed requests count)
METRICS: dict[str, tuple[str, str]] = {
    "ttft": ("time_to_first_token_ms", "all"),
    "ttft_warm": ("time_to_first_token_ms", "warm"),
    "ttft_cold": ("time_to_first_token_ms", "cold"),
    "itl": ("inter_token_ms", "all"),
    "latency": ("latency_ms", "all"),
    "queue": ("queue_ms", "all"),
}
COUNTS = ("requests", "completed", "errors", "cold_requests", "retried", "billed", "disconnects",
          "prompt_tokens", "completion_tokens", "ttft_requests", "slo_met")
COLD_TIERS = (UsageRecord.AdapterTier.HOST, UsageRecord.AdapterTier.DISK)
P_NAMES = tuple(f"p{round(p * 100)}" for p in PERCENTILES)
PERCENTILE_FIELDS = tuple(f"{metric}_{p}_ms" for metric in METRICS for p in P_NAMES)
# The ledger columns a dimension's key comes from ("" key for NULL / "all").
DIMENSION_COLUMNS = {Dimension.TENANT: "tenant_id", Dimension.MODEL: "model",
                     Dimension.VERSION: "adapter_version_id", Dimension.WORKER: "worker_url"}


def floor_to(moment: datetime, width: timedelta) -> datetime:
    """The start of the width-wide bucket `moment` falls in (date_bin on the Unix epoch)."""
    return moment - (moment - EPOCH) % width


# -- the aggregate, as SQL and in Python --------------------------------------------------------
def bucket_aggregates(*, width: timedelta, start: datetime, end: datetime, filters: dict[str, str]) -> list[dict]:
    """The roll-up numbers of the ledger rows created in [start, end) that match `filters`
    ({dimension: key}), one dict per width-wide bucket with rows (UsageRollup's fields)."""
    if not database_has_percentile_cont():
        return aggregate_python(width=width, start=start, end=end, filters=filters, grouping_sets=False)
    select, params = aggregate_sql(width=width, start=start, end=end, filters=filters, grouping_sets=False)
    with connection.cursor() as cursor:
        cursor.execute(select, params)
        names = [column.name for column in cursor.description]
        return [dict(zip(names, row, strict=True)) for row in cursor.fetchall()]


def ttft_target_sql() -> tuple[str, list]:
    """The tenant's TTFT target as SQL over tenants_tenant `t` (ttft_target in SQL)."""
    cases = " ".join("WHEN %s THEN %s" for _ in PLANS)
    params: list = [value for name, plan in PLANS.items() for value in (name, plan.ttft_p95_target_ms)]
    return (f"COALESCE(t.ttft_p95_target_ms, CASE t.plan {cases} ELSE %s END)",
            [*params, plan_for("").ttft_p95_target_ms])


def aggregate_sql(*, width: timedelta, start: datetime, end: datetime, filters: dict[str, str],
                   grouping_sets: bool) -> tuple[str, list]:
    """SELECT bucket, dimension, key, COUNTS..., PERCENTILE_FIELDS... over the ledger.

    grouping_sets: one row per (bucket, group) for all five dimensions, else one per bucket
    (dimension "all"). Percentile columns come from one percentile_cont(ARRAY[...]) per metric
    (one sort per metric and group, not three)."""
    completed = "(r.status_code < 400 AND r.error = '' AND NOT r.client_disconnected)"
    cold = "r.adapter_tier IN (%s, %s)"
    subsets = {"all": completed, "warm": f"{completed} AND NOT {cold}", "cold": f"{completed} AND {cold}"}
    target, target_params = ttft_target_sql()
    fractions = ", ".join(repr(float(p)) for p in PERCENTILES)  # our own float literals
    select = ["r.bucket"]
    if grouping_sets:
        dimension, key = "CASE", "CASE"
        for name, column in DIMENSION_COLUMNS.items():
            dimension += f" WHEN GROUPING(r.{column}) = 0 THEN '{name}'"
            key += f" WHEN GROUPING(r.{column}) = 0 THEN COALESCE(r.{column}::text, '')"
        select += [f"{dimension} ELSE 'all' END AS dimension", f"{key} ELSE '' END AS key"]
    else:
        select += ["'all' AS dimension", "'' AS key"]
    select += [
        "count(*) AS requests",
        f"count(*) FILTER (WHERE {completed}) AS completed",
        "count(*) FILTER (WHERE r.status_code >= 400 OR r.error <> '') AS errors",
        f"count(*) FILTER (WHERE {cold}) AS cold_requests",
        "count(*) FILTER (WHERE r.upstream_attempts > 1) AS retried",
        "count(*) FILTER (WHERE r.prompt_tokens > 0 OR r.completion_tokens > 0) AS billed",
        "count(*) FILTER (WHERE r.client_disconnected) AS disconnects",
        "coalesce(sum(r.prompt_tokens), 0) AS prompt_tokens",
        "coalesce(sum(r.completion_tokens), 0) AS completion_tokens",
        f"count(r.time_to_first_token_ms) FILTER (WHERE {completed}) AS ttft_requests",
        f"count(*) FILTER (WHERE {completed} AND r.time_to_first_token_ms <= {target}) AS slo_met",
    ]
    select_params: list = [*COLD_TIERS, *target_params]
    for metric, (column, subset) in METRICS.items():
        select.append(f"percentile_cont(ARRAY[{fractions}]) WITHIN GROUP (ORDER BY r.{column}) "
                      f"FILTER (WHERE {subsets[subset]}) AS {metric}")
        select_params += list(COLD_TIERS) if subset != "all" else []
    # The ledger rows of the window, each with its bucket (a derived table, so that GROUPING
    # SETS can name the bucket as a column).
    where = ["created_at >= %s", "created_at < %s"]
    where_params: list = [start, end]
    for dimension, value in filters.items():
        column = DIMENSION_COLUMNS[dimension]
        if dimension == Dimension.VERSION and value == "":
            where.append(f"{column} IS NULL")
        elif dimension in (Dimension.TENANT, Dimension.VERSION):
            where.append(f"{column} = %s")
            where_params.append(int(value))
        else:
            where.append(f"{column} = %s")
            where_params.append(str(value))
    source = (f"SELECT date_bin(make_interval(secs => %s), created_at, %s) AS bucket, * "
              f"FROM {UsageRecord._meta.db_table} WHERE {' AND '.join(where)}")
    source_params = [width.total_seconds(), EPOCH, *where_params]
    group = ("GROUPING SETS ((r.bucket), " + ", ".join(f"(r.bucket, r.{column})" for column in DIMENSION_COLUMNS.values())
             + ")" if grouping_sets else "r.bucket")
    inner = (f"SELECT {', '.join(select)} FROM ({source}) r "
             f"JOIN {Tenant._meta.db_table} t ON t.id = r.tenant_id GROUP BY {group}")
    # Unpack each metric's [p50, p95, p99] array into its three columns.
    unpacked = [f"{metric}[{i + 1}] AS {metric}_{p}_ms" for metric in METRICS for i, p in enumerate(P_NAMES)]
    outer = f"SELECT bucket, dimension, key, {', '.join(COUNTS)}, {', '.join(unpacked)} FROM ({inner}) AS g ORDER BY bucket"
    return outer, [*select_params, *source_params]


def aggregate_python(*, width: timedelta, start: datetime, end: datetime, filters: dict[str, str],
                      grouping_sets: bool) -> list[dict]:
    """aggregate_sql's numbers computed in Python (databases without percentile_cont)."""
    records = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end)
    for dimension, value in filters.items():
        column = DIMENSION_COLUMNS[dimension]
        records = (records.filter(**{f"{column}__isnull": True}) if value == "" and dimension == Dimension.VERSION
                   else records.filter(**{column: value}))
    targets = {pk: ttft_target(plan=plan, override_ms=override)[0]
               for pk, plan, override in Tenant.objects.values_list("pk", "plan", "ttft_p95_target_ms")}
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    fields = ("created_at", *DIMENSION_COLUMNS.values(), "status_code", "error", "client_disconnected",
              "adapter_tier", "upstream_attempts", "prompt_tokens", "completion_tokens",
              *dict.fromkeys(column for column, _ in METRICS.values()))
    for row in records.values(*fields).iterator():
        bucket = floor_to(row["created_at"].astimezone(UTC), width)
        groups[(bucket, Dimension.ALL, "")].append(row)
        if grouping_sets:
            for dimension, column in DIMENSION_COLUMNS.items():
                key = "" if row[column] is None else str(row[column])
                groups[(bucket, dimension, key)].append(row)
    out = []
    for (bucket, dimension, key), rows in sorted(groups.items()):
        completed = [r for r in rows if r["status_code"] < 400 and r["error"] == "" and not r["client_disconnected"]]
        subsets = {"all": completed,
                   "warm": [r for r in completed if r["adapter_tier"] not in COLD_TIERS],
                   "cold": [r for r in completed if r["adapter_tier"] in COLD_TIERS]}
        with_ttft = [r for r in completed if r["time_to_first_token_ms"] is not None]
        aggregate = {
            "bucket": bucket, "dimension": str(dimension), "key": key, "requests": len(rows),
            "completed": len(completed),
            "errors": sum(1 for r in rows if r["status_code"] >= 400 or r["error"] != ""),
            "cold_requests": sum(1 for r in rows if r["adapter_tier"] in COLD_TIERS),
            "retried": sum(1 for r in rows if r["upstream_attempts"] > 1),
            "billed": sum(1 for r in rows if r["prompt_tokens"] or r["completion_tokens"]),
            "disconnects": sum(1 for r in rows if r["client_disconnected"]),
            "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
            "completion_tokens": sum(r["completion_tokens"] for r in rows),
            "ttft_requests": len(with_ttft),
            "slo_met": sum(1 for r in with_ttft if r["time_to_first_token_ms"] <= targets[r["tenant_id"]]),
        }
        for metric, (column, subset) in METRICS.items():
            values = [r[column] for r in subsets[subset]]
            for p, name in zip(PERCENTILES, P_NAMES, strict=True):
                aggregate[f"{metric}_{name}_ms"] = percentile_cont(values, p)
        out.append(aggregate)
    return out

"""Reads for the operator dashboards over a TimeRange (portal.core.ranges): latency percentiles,
errors and TTFT objectives per bucket. JSON-ready dicts; every number exact.

Where each number comes from (never an average of percentiles):
- Percentiles of a bucket come from the UsageRollup row of that bucket when the bucket is a
  roll-up granularity (1m, 1h, 1d) and at most one filter is set; from the ledger (the same
  aggregate, percentile_cont grouped by date_bin) with two or more filters, or for 5m / 15m / 6h
  buckets over ranges up to LEDGER_UP_TO (6 h). Longer ranges with those buckets are served at the
  nearest roll-up granularity (the finer one when it keeps the chart under 10x MAX_POINTS
  points); the JSON's "bucket" says what was served.
- Counts (requests, errors, retries, SLO met; errors by status and code in UsageErrorRollup) add
  up, so a bucket or a range is the sum of the coarsest roll-up rows that fit inside it (_cover),
  the edges and the live tail from the ledger.
- Buckets from the one the last roll-up run was in onwards (the last minute or two for minute
  rows) are read from the ledger at query time, so a live view is current to the second.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from django.db import connection
from django.db.models import Q, Sum
from django.utils import timezone

from portal.adapters.models import AdapterVersion
from portal.core.exceptions import InvalidInput
from portal.core.ranges import BUCKETS, EPOCH, MAX_POINTS, TimeRange
from portal.tenants.models import Tenant
from portal.tenants.plans import plan_for, ttft_target
from portal.usage.aggregates import (
    DIMENSION_COLUMNS,
    P_NAMES,
    RETENTION,
    WIDTHS,
    Dimension,
    bucket_aggregates,
    floor_to,
    ttft_target_sql,
)
from portal.usage.billing import money, token_cost
from portal.usage.models import ERROR_Q, RollupWatermark, UsageErrorRollup, UsageRecord, UsageRollup
from portal.usage.percentiles import PercentileCont, database_has_percentile_cont, percentile_cont

# 5m / 15m / 6h buckets are computed from the ledger for ranges up to this long (bench/dashboards.py:
# 6 h of a 2M-rows month took ~150 ms, 24 h ~630 ms on 2 busy cores); longer ranges snap.
LEDGER_UP_TO = timedelta(hours=6)
# The SLO page's p95 over the whole range is a percentile over every request of the range: exact
# only from the ledger, so it is given for ranges up to this long (None beyond).
SLO_P95_UP_TO = timedelta(hours=24)
SLO_WINDOW = timedelta(minutes=15)  # "missing it now": the p95 over the last 15 minutes
_JSON_METRICS = {"ttft": "ttft_ms", "ttft_warm": "ttft_warm_ms", "ttft_cold": "ttft_cold_ms",
                 "itl": "itl_ms", "latency": "latency_ms", "queue": "queue_ms"}
_BY_WIDTH = {width: name for name, width in WIDTHS.items()}


# -- latency ----------------------------------------------------------------------------------
def latency_series(*, time_range: TimeRange, tenant: str | None = None, model: str | None = None,
                   version: str | int | None = None, worker: str | None = None) -> dict:
    """TTFT (all / warm / cold), inter-token, end-to-end and queue p50/p95/p99 per bucket over
    completed requests, with request counts; filters: tenant slug, model id, version id, worker url."""
    filters = _without_implied(_filters(tenant=tenant, model=model, version=version, worker=worker))
    now = timezone.now()
    width, granularity = _latency_source(time_range, filters, now)
    starts = _starts(time_range, width)
    found: dict[datetime, dict] = {}
    live_from = None
    if granularity is None:
        source = "ledger"
        rows = bucket_aggregates(width=width, start=starts[0], end=time_range.end, filters=filters)
    else:
        source = f"rollup:{granularity}"
        # A live range reads what the last run has not finished from the ledger, current to the
        # second. Another takes the roll-ups' buckets as the last run (a minute ago, with beat
        # running) left them: recomputing today's day bucket from the ledger on every load of a
        # 30-day view cost ~0.6 s on 2M rows a month (bench/dashboards.py).
        live_from = max(_live_from(granularity, starts[0]), starts[0]) if time_range.live else time_range.end
        dimension, key = _dimension(filters)
        rows = list(UsageRollup.objects.filter(
            granularity=granularity, dimension=dimension, key=key, bucket__gte=starts[0],
            bucket__lt=min(live_from, time_range.end)).values())
        if live_from < time_range.end:
            rows += bucket_aggregates(width=width, start=live_from, end=time_range.end, filters=filters)
    for row in rows:
        found[row["bucket"].astimezone(UTC)] = row
    buckets = [_latency_bucket(start, found.get(start)) for start in starts]
    return {
        "range": time_range.as_json(), "bucket": _bucket_name(width), "bucket_seconds": int(width.total_seconds()),
        "filters": {"tenant": tenant or None, "model": model or None,
                    "version": str(version) if version not in (None, "") else None, "worker": worker or None},
        "source": source, "live_from": live_from.isoformat() if live_from and live_from < time_range.end else None,
        "requests": sum(b["requests"] for b in buckets), "cold_requests": sum(b["cold_requests"] for b in buckets),
        "buckets": buckets,
    }


def latency_filters(*, time_range: TimeRange) -> dict:
    """The tenants, models, versions and workers with requests in the range, for the pickers.

    From the coarsest roll-up rows that fit inside the range (day rows for its whole days, hour
    and minute rows at the edges) and the ledger for the rest."""
    keys: dict[str, set[str]] = defaultdict(set)
    segments = _cover(time_range.start, time_range.end, tuple(WIDTHS))
    rolled = _segments_q([segment for segment in segments if segment[0] is not None])
    if rolled is not None:
        for dimension, key in (UsageRollup.objects.filter(rolled).exclude(dimension=Dimension.ALL)
                               .values_list("dimension", "key").order_by().distinct()):
            keys[dimension].add(key)
    for _, start, end in (segment for segment in segments if segment[0] is None):
        tail = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end)
        for dimension, column in DIMENSION_COLUMNS.items():
            keys[dimension] |= {"" if value is None else str(value)
                                for value in tail.values_list(column, flat=True).order_by().distinct()}
    tenant_ids = [int(key) for key in keys[Dimension.TENANT] if key]
    version_ids = [int(key) for key in keys[Dimension.VERSION] if key]
    versions = AdapterVersion.objects.filter(pk__in=version_ids).select_related("adapter__tenant")
    return {
        "tenants": sorted(Tenant.objects.filter(pk__in=tenant_ids).values_list("slug", flat=True)),
        "models": sorted(keys[Dimension.MODEL] - {""}),
        "versions": sorted(({"id": v.pk, "label": v.public_id} for v in versions), key=lambda v: v["label"]),
        "workers": sorted(keys[Dimension.WORKER] - {""}),
    }


# -- errors -----------------------------------------------------------------------------------
def error_series(*, time_range: TimeRange, tenant: str | None = None) -> dict:
    """Errors per bucket by (status, code), upstream retries and requests per bucket, and per
    tenant over the range: requests, errors and errors by "status code"."""
    filters = _filters(tenant=tenant)
    starts = _starts(time_range, time_range.bucket)
    index = {start: i for i, start in enumerate(starts)}
    counts = _counts(time_range=time_range, filters=filters, start=starts[0])
    errors = _errors(time_range=time_range, filters=filters, start=starts[0])
    series: dict[tuple[int, str], list[int]] = {}
    by_tenant_codes: dict[int, dict[str, int]] = defaultdict(dict)
    for bucket, tenant_id, status, code, n in errors:
        if bucket is not None:
            series.setdefault((status, code), [0] * len(starts))[index[bucket]] += n
        else:
            by_tenant_codes[tenant_id][f"{status} {code}".strip()] = n
    slugs = dict(Tenant.objects.filter(pk__in=[*counts["tenants"], *by_tenant_codes]).values_list("pk", "slug"))
    by_tenant = [{"slug": slugs[tenant_id], "requests": counts["tenants"].get(tenant_id, {}).get("requests", 0),
                  "errors": sum(by_tenant_codes[tenant_id].values()),
                  "by_code": dict(sorted(by_tenant_codes[tenant_id].items(), key=lambda item: (-item[1], item[0])))}
                 for tenant_id in set(counts["tenants"]) | set(by_tenant_codes)]
    by_tenant.sort(key=lambda t: (-t["errors"], -t["requests"], t["slug"]))
    return {
        "range": time_range.as_json(), "tenant": tenant or None, "buckets": [start.isoformat() for start in starts],
        "series": [{"status": status, "code": code, "counts": values} for (status, code), values in
                   sorted(series.items(), key=lambda item: (-sum(item[1]), item[0]))],
        "requests": [counts["buckets"].get(start, {}).get("requests", 0) for start in starts],
        "errors": [counts["buckets"].get(start, {}).get("errors", 0) for start in starts],
        "retries": [counts["buckets"].get(start, {}).get("retried", 0) for start in starts],
        "by_tenant": by_tenant,
    }


# -- TTFT objectives --------------------------------------------------------------------------
def slo_summary(*, time_range: TimeRange) -> dict:
    """Per tenant with requests in the range: its TTFT p95 target and where it comes from, the
    completed requests with a TTFT, how many met the target and the share, the p95 over the
    range (ranges up to SLO_P95_UP_TO) and over the last 15 minutes, and whether it misses now."""
    now = timezone.now()
    starts = _starts(time_range, time_range.bucket)
    counts = _counts(time_range=time_range, filters={}, start=starts[0], per_bucket=False)["tenants"]
    window_start = now - SLO_WINDOW
    p95_now = _p95_by_tenant(start=window_start, end=now)
    over_range = (_p95_by_tenant(start=starts[0], end=time_range.end)
                  if time_range.end - starts[0] <= SLO_P95_UP_TO else {})
    tenants = []
    for tenant in Tenant.objects.filter(pk__in=set(counts) | set(p95_now)).order_by("slug"):
        target, source = ttft_target(plan=tenant.plan, override_ms=tenant.ttft_p95_target_ms)
        row = counts.get(tenant.pk, {})
        completed, met = row.get("ttft_requests", 0), row.get("slo_met", 0)
        now_p95 = p95_now.get(tenant.pk)
        tenants.append({
            "slug": tenant.slug, "plan": tenant.plan, "target_ms": target, "target_source": source,
            "requests": row.get("requests", 0), "completed": completed, "met": met,
            "share": met / completed if completed else None,
            "p95_ms": over_range.get(tenant.pk), "p95_now_ms": now_p95,
            "missing_now": now_p95 is not None and now_p95 > target,
        })
    tenants.sort(key=lambda t: (not t["missing_now"], t["share"] if t["share"] is not None else 2.0, t["slug"]))
    return {"range": time_range.as_json(), "window_minutes": int(SLO_WINDOW.total_seconds() // 60),
            "p95_over_range": time_range.end - starts[0] <= SLO_P95_UP_TO, "tenants": tenants}


# -- tenants ----------------------------------------------------------------------------------
def usage_totals(*, time_range: TimeRange) -> dict:
    """Per tenant over the range (from the roll-ups, any length): requests, errors, quota
    rejections (429 rows), client disconnects, tokens and spend at the plan's prices; busiest
    first. The roll-up twin of dashboards.selectors.tenants_summary, for time ranges."""
    starts = _starts(time_range, time_range.bucket)
    counts = _counts(time_range=time_range, filters={}, start=starts[0], per_bucket=False)["tenants"]
    rejected: dict[int, int] = defaultdict(int)
    for bucket, tenant_id, status, _code, n in _errors(time_range=time_range, filters={}, start=starts[0],
                                                       per_bucket=False):
        if bucket is None and status == 429:
            rejected[tenant_id] += n
    tenants = []
    for tenant in Tenant.objects.filter(pk__in=counts):
        row = counts[tenant.pk]
        plan = plan_for(tenant.plan)
        prompt, completion = row["prompt_tokens"], row["completion_tokens"]
        spend = token_cost(prompt, plan.prompt_price_per_million) + token_cost(completion, plan.completion_price_per_million)
        tenants.append({
            "slug": tenant.slug, "name": tenant.name, "plan": tenant.plan, "status": tenant.status,
            "requests": row["requests"], "billed_requests": row["billed"], "errors": row["errors"],
            "quota_rejections": rejected[tenant.pk],
            "disconnects": row["disconnects"], "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "spend": money(spend),
        })
    tenants.sort(key=lambda t: (-t["total_tokens"], -t["requests"], t["slug"]))
    return {"range": time_range.as_json(), "tenants": tenants}


# -- helpers ----------------------------------------------------------------------------------
def _filters(*, tenant: str | None = None, model: str | None = None, version: str | int | None = None,
             worker: str | None = None) -> dict[str, str]:
    """{dimension: roll-up key}; InvalidInput for an unknown tenant or a version that is no id."""
    filters: dict[str, str] = {}
    if tenant:
        tenant_id = Tenant.objects.filter(slug=tenant).values_list("pk", flat=True).first()
        if tenant_id is None:
            raise InvalidInput("tenant", f"no tenant {tenant[:60]!r}")
        filters[Dimension.TENANT] = str(tenant_id)
    if model:
        filters[Dimension.MODEL] = model
    if version not in (None, ""):
        if isinstance(version, bool) or not str(version).isdigit() or int(version) >= 2**31:
            raise InvalidInput("version", f"an adapter version id (a positive integer), got {str(version)[:40]!r}")
        filters[Dimension.VERSION] = str(int(version))
    if worker:
        filters[Dimension.WORKER] = worker
    return filters


def _without_implied(filters: dict[str, str]) -> dict[str, str]:
    """The filters less those another implies, so that more selections read one roll-up
    dimension: an adapter's model id ("acme/bot", "acme/bot@v2") and a version each name their
    tenant, so a tenant filter beside one of them selects nothing more."""
    tenant_id = filters.get(Dimension.TENANT)
    if tenant_id is None or len(filters) < 2:
        return filters
    slug = Tenant.objects.filter(pk=int(tenant_id)).values_list("slug", flat=True).first()
    model, version = filters.get(Dimension.MODEL), filters.get(Dimension.VERSION)
    implied = (model is not None and model.startswith(f"{slug}/")) or (
        version is not None and AdapterVersion.objects.filter(pk=int(version), adapter__tenant_id=int(tenant_id)).exists())
    return {k: v for k, v in filters.items() if k != Dimension.TENANT} if implied else filters


def _dimension(filters: dict[str, str]) -> tuple[str, str]:
    return next(iter(filters.items()), (Dimension.ALL, ""))


def _usable(granularity: str, first: datetime, now: datetime) -> bool:
    """Whether the roll-ups of `granularity` hold buckets from `first` on (retention, and ran once)."""
    keep = RETENTION[granularity]
    if keep is not None and first < floor_to(now - keep, WIDTHS[granularity]):
        return False
    return RollupWatermark.objects.filter(granularity=granularity, covered_until__isnull=False).exists()


def _latency_source(time_range: TimeRange, filters: dict, now: datetime) -> tuple[timedelta, str | None]:
    """(bucket width served, roll-up granularity or None for the ledger)."""
    asked = time_range.bucket
    if len(filters) >= 2:
        return asked, None
    granularity = _BY_WIDTH.get(asked)
    if granularity and _usable(granularity, floor_to(time_range.start, asked), now):
        return asked, granularity
    if time_range.end - time_range.start <= LEDGER_UP_TO:
        return asked, None
    span = time_range.end - time_range.start
    finer = [g for g, w in WIDTHS.items() if w < asked and span / w <= 10 * MAX_POINTS]
    coarser = [g for g, w in WIDTHS.items() if w > asked]
    for candidate in [*reversed(finer), *coarser]:
        width = WIDTHS[candidate]
        if _usable(candidate, floor_to(time_range.start, width), now):
            return width, candidate
    return asked, None


def _live_from(granularity: str, first: datetime) -> datetime:
    """Start of the first bucket the roll-ups may not hold complete: the one the last run was in."""
    covered = (RollupWatermark.objects.filter(granularity=granularity)
               .values_list("covered_until", flat=True).first())
    return floor_to(covered, WIDTHS[granularity]) if covered is not None else first


def _starts(time_range: TimeRange, width: timedelta) -> list[datetime]:
    starts, moment = [], floor_to(time_range.start, width)
    while moment < time_range.end:
        starts.append(moment)
        moment += width
    return starts


def _bucket_name(width: timedelta) -> str:
    return next(name for name, value in BUCKETS.items() if value == width)


def _latency_bucket(start: datetime, row: dict | None) -> dict:
    row = row or {}
    return {
        "start": start.isoformat(), "requests": row.get("requests", 0), "completed": row.get("completed", 0),
        "errors": row.get("errors", 0), "cold_requests": row.get("cold_requests", 0),
        "prompt_tokens": row.get("prompt_tokens", 0), "completion_tokens": row.get("completion_tokens", 0),
        **{name: {p: row.get(f"{metric}_{p}_ms") for p in P_NAMES} for metric, name in _JSON_METRICS.items()},
    }


_COUNTS = ("requests", "errors", "retried", "billed", "disconnects", "prompt_tokens", "completion_tokens", "ttft_requests",
           "slo_met")


def _cover(start: datetime, end: datetime, granularities: tuple[str, ...]) -> list[tuple[str | None, datetime, datetime]]:
    """[start, end) as segments (granularity, from, to) of complete roll-up buckets, coarsest
    first, and (None, from, to) for what only the ledger holds (the edges, the live tail)."""
    now = timezone.now()
    marks = dict(RollupWatermark.objects.filter(covered_until__isnull=False).values_list("granularity", "covered_until"))
    levels = []
    for granularity in sorted(granularities, key=lambda g: -WIDTHS[g]):
        if granularity in marks:
            width, keep = WIDTHS[granularity], RETENTION[granularity]
            horizon = floor_to(now - keep, width) + width if keep is not None else None
            levels.append((granularity, width, floor_to(marks[granularity], width), horizon))

    def cover(lower: datetime, upper: datetime, levels: list) -> list:
        if lower >= upper:
            return []
        if not levels:
            return [(None, lower, upper)]
        (granularity, width, live_from, horizon), finer = levels[0], levels[1:]
        first = floor_to(lower, width) + (width if floor_to(lower, width) < lower else timedelta(0))
        if horizon is not None:
            first = max(first, horizon)
        last = min(floor_to(upper, width), live_from)
        if first >= last:
            return cover(lower, upper, finer)
        return [*cover(lower, first, finer), (granularity, first, last), *cover(last, upper, finer)]

    return cover(start, end, levels)


def _segments_q(segments) -> Q | None:
    q = None
    for granularity, start, end in segments:
        part = Q(granularity=granularity, bucket__gte=start, bucket__lt=end)
        q = part if q is None else q | part
    return q


def _counts(*, time_range: TimeRange, filters: dict[str, str], start: datetime, per_bucket: bool = True) -> dict:
    """Counts per bucket of the range's own width (buckets: {start: {...}}) and per tenant over
    the range (tenants: {tenant_id: {...}}): sums of the coarsest roll-up rows that fit (for the
    buckets, of granularities that divide the bucket width) and the ledger for the rest."""
    width = time_range.bucket
    buckets: dict[datetime, dict] = defaultdict(lambda: dict.fromkeys(_COUNTS, 0))
    tenants: dict[int, dict] = defaultdict(lambda: dict.fromkeys(_COUNTS, 0))
    tenant_key = filters.get(Dimension.TENANT)
    sums = {name: Sum(name) for name in _COUNTS}
    # One tenant: its rows only; none: the "all" rows per bucket and the tenant rows per tenant.
    # (key="" too, so that PostgreSQL reads the unique (granularity, dimension, key, bucket) index.)
    kept = Q(dimension=Dimension.TENANT, key=tenant_key) if tenant_key else Q(dimension=Dimension.ALL, key="")
    dividing = tuple(g for g, w in WIDTHS.items() if width % w == timedelta(0))
    per_bucket = _cover(start, time_range.end, dividing) if per_bucket else []
    rolled = _segments_q([segment for segment in per_bucket if segment[0] is not None])
    if rolled is not None:
        for row in UsageRollup.objects.filter(rolled, kept).values("bucket").annotate(**sums).order_by():
            bucket = floor_to(row["bucket"].astimezone(UTC), width)
            for name in _COUNTS:
                buckets[bucket][name] += row[name]
    per_tenant = _cover(start, time_range.end, tuple(WIDTHS))
    rolled = _segments_q([segment for segment in per_tenant if segment[0] is not None])
    if rolled is not None:
        kept = Q(dimension=Dimension.TENANT, key=tenant_key) if tenant_key else Q(dimension=Dimension.TENANT)
        for row in UsageRollup.objects.filter(rolled, kept).values("key").annotate(**sums).order_by():
            for name in _COUNTS:
                tenants[int(row["key"])][name] += row[name]
    for segments, into_buckets in ((per_bucket, True), (per_tenant, False)):
        for _, lower, upper in (segment for segment in segments if segment[0] is None):
            for bucket, tenant_id, values in _ledger_counts(start=lower, end=upper, width=width, filters=filters):
                for name in _COUNTS:
                    if into_buckets:
                        buckets[bucket][name] += values[name]
                    else:
                        tenants[tenant_id][name] += values[name]
    return {"buckets": buckets, "tenants": tenants}


def _ledger_counts(*, start: datetime, end: datetime, width: timedelta, filters: dict[str, str]):
    """(bucket, tenant_id, {count: n}) from the ledger, for what the roll-ups do not hold."""
    records = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end)
    if Dimension.TENANT in filters:
        records = records.filter(tenant_id=int(filters[Dimension.TENANT]))
    if database_has_percentile_cont():
        sql, params = records.values("created_at", "tenant_id", "status_code", "error", "client_disconnected",
                                     "upstream_attempts", "prompt_tokens", "completion_tokens",
                                     "time_to_first_token_ms").query.sql_with_params()
        target, target_params = ttft_target_sql()
        completed = "r.status_code < 400 AND r.error = '' AND NOT r.client_disconnected"
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT date_bin(make_interval(secs => %s), r.created_at, %s) AS bucket, r.tenant_id, count(*), "
                "count(*) FILTER (WHERE r.status_code >= 400 OR r.error <> ''), "
                "count(*) FILTER (WHERE r.upstream_attempts > 1), "
                "count(*) FILTER (WHERE r.prompt_tokens > 0 OR r.completion_tokens > 0), "
                "count(*) FILTER (WHERE r.client_disconnected), "
                "coalesce(sum(r.prompt_tokens), 0), coalesce(sum(r.completion_tokens), 0), "
                f"count(r.time_to_first_token_ms) FILTER (WHERE {completed}), "
                f"count(*) FILTER (WHERE {completed} AND r.time_to_first_token_ms <= {target}) "
                f"FROM ({sql}) AS r JOIN {Tenant._meta.db_table} t ON t.id = r.tenant_id GROUP BY 1, 2",
                [width.total_seconds(), EPOCH, *target_params, *params])
            for bucket, tenant_id, *values in cursor.fetchall():
                yield bucket.astimezone(UTC), tenant_id, dict(zip(_COUNTS, values, strict=True))
        return
    targets = {pk: ttft_target(plan=plan, override_ms=override)[0]
               for pk, plan, override in Tenant.objects.values_list("pk", "plan", "ttft_p95_target_ms")}
    grouped: dict[tuple[datetime, int], dict] = defaultdict(lambda: dict.fromkeys(_COUNTS, 0))
    for row in records.values("created_at", "tenant_id", "status_code", "error", "client_disconnected",
                              "upstream_attempts", "prompt_tokens", "completion_tokens",
                              "time_to_first_token_ms").iterator():
        values = grouped[(floor_to(row["created_at"].astimezone(UTC), width), row["tenant_id"])]
        completed = row["status_code"] < 400 and row["error"] == "" and not row["client_disconnected"]
        ttft = row["time_to_first_token_ms"]
        values["requests"] += 1
        values["errors"] += row["status_code"] >= 400 or row["error"] != ""
        values["retried"] += row["upstream_attempts"] > 1
        values["billed"] += bool(row["prompt_tokens"] or row["completion_tokens"])
        values["disconnects"] += row["client_disconnected"]
        values["prompt_tokens"] += row["prompt_tokens"]
        values["completion_tokens"] += row["completion_tokens"]
        values["ttft_requests"] += completed and ttft is not None
        values["slo_met"] += completed and ttft is not None and ttft <= targets[row["tenant_id"]]
    yield from ((bucket, tenant_id, values) for (bucket, tenant_id), values in grouped.items())


def _errors(*, time_range: TimeRange, filters: dict[str, str], start: datetime,
            per_bucket: bool = True) -> list[tuple]:
    """(bucket, None, status, code, n) per bucket of the range's width and (None, tenant_id,
    status, code, n) per tenant over the range: UsageErrorRollup sums (as _counts) and the ledger."""
    width = time_range.bucket
    by_bucket: dict[tuple, int] = defaultdict(int)
    by_tenant: dict[tuple, int] = defaultdict(int)
    rows = UsageErrorRollup.objects.all()
    if Dimension.TENANT in filters:
        rows = rows.filter(tenant_id=int(filters[Dimension.TENANT]))
    dividing = tuple(g for g, w in WIDTHS.items() if width % w == timedelta(0))
    wanted = ((True, dividing), (False, tuple(WIDTHS))) if per_bucket else ((False, tuple(WIDTHS)),)
    for bucketed, granularities in wanted:
        segments = _cover(start, time_range.end, granularities)
        rolled = _segments_q([segment for segment in segments if segment[0] is not None])
        if rolled is not None:
            group = ("bucket" if bucketed else "tenant_id", "status_code", "error_code")
            for row in rows.filter(rolled).values(*group).annotate(n=Sum("count")).order_by():
                if bucketed:
                    by_bucket[(floor_to(row["bucket"].astimezone(UTC), width), row["status_code"],
                               row["error_code"])] += row["n"]
                else:
                    by_tenant[(row["tenant_id"], row["status_code"], row["error_code"])] += row["n"]
        for _, lower, upper in (segment for segment in segments if segment[0] is None):
            for bucket, tenant_id, status, code, n in _error_rows(start=lower, end=upper, width=width, filters=filters):
                if bucketed and bucket is not None:
                    by_bucket[(bucket.astimezone(UTC), status, code)] += n
                elif not bucketed and bucket is None:
                    by_tenant[(tenant_id, status, code)] += n
    return ([(bucket, None, status, code, n) for (bucket, status, code), n in by_bucket.items()]
            + [(None, tenant_id, status, code, n) for (tenant_id, status, code), n in by_tenant.items()])


def _error_rows(*, start: datetime, end: datetime, width: timedelta, filters: dict[str, str]):
    """(bucket, None, status, code, n) per bucket and (None, tenant_id, status, code, n) per
    tenant over [start, end), from the ledger's error rows (its partial index)."""
    records = UsageRecord.objects.filter(ERROR_Q, created_at__gte=start, created_at__lt=end)
    if Dimension.TENANT in filters:
        records = records.filter(tenant_id=int(filters[Dimension.TENANT]))
    if database_has_percentile_cont():
        sql, params = records.values("created_at", "tenant_id", "status_code", "error_code").query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT CASE WHEN GROUPING(bucket) = 0 THEN bucket END, CASE WHEN GROUPING(tenant_id) = 0 "
                "THEN tenant_id END, status_code, error_code, count(*) FROM (SELECT date_bin(make_interval(secs => %s), "
                f"created_at, %s) AS bucket, tenant_id, status_code, error_code FROM ({sql}) AS e) AS errors "
                "GROUP BY GROUPING SETS ((bucket, status_code, error_code), (tenant_id, status_code, error_code))",
                [width.total_seconds(), EPOCH, *params])
            return cursor.fetchall()
    by_bucket: dict[tuple, int] = defaultdict(int)
    by_tenant: dict[tuple, int] = defaultdict(int)
    for created_at, tenant_id, status, code in records.values_list("created_at", "tenant_id", "status_code",
                                                                    "error_code").iterator():
        by_bucket[(floor_to(created_at.astimezone(UTC), width), status, code)] += 1
        by_tenant[(tenant_id, status, code)] += 1
    return ([(bucket, None, status, code, n) for (bucket, status, code), n in by_bucket.items()]
            + [(None, tenant_id, status, code, n) for (tenant_id, status, code), n in by_tenant.items()])


def _p95_by_tenant(*, start: datetime, end: datetime) -> dict[int, float]:
    """Exact TTFT p95 per tenant over completed requests created in [start, end)."""
    records = UsageRecord.objects.filter(created_at__gte=start, created_at__lt=end, status_code__lt=400, error="",
                                         client_disconnected=False, time_to_first_token_ms__isnull=False)
    if database_has_percentile_cont():
        return dict(records.values("tenant_id").annotate(p95=PercentileCont("time_to_first_token_ms", 0.95))
                    .order_by().values_list("tenant_id", "p95"))
    values: dict[int, list[float]] = defaultdict(list)
    for tenant_id, ttft in records.values_list("tenant_id", "time_to_first_token_ms").iterator():
        values[tenant_id].append(ttft)
    return {tenant_id: percentile_cont(ttfts, 0.95) for tenant_id, ttfts in values.items()}


"""Minute, hour and day roll-ups of the ledger (UsageRollup): exact percentiles per bucket.

One aggregate, two engines. On PostgreSQL one statement per window of buckets computes every
group at once (GROUP BY GROUPING SETS over date_bin buckets: all / tenant / model / version /
worker) with percentile_cont in the database and INSERTs the rows it returns; elsewhere
(SQLite in `make run`) the same numbers come from Python (portal.usage.aggregates). The
dashboards read the same aggregate straight from the ledger for what the roll-ups do not hold
(two filters, odd buckets, the minute or two since the last run).

Freshness: usage_rollup_refresh (Celery beat, every minute) recomputes, per granularity, every
bucket that received ledger rows since the last run (recorded_at after the watermark, less a
grace for rows still committing) plus the current bucket; delete + insert in one transaction,
so a run is idempotent and readers never see half a bucket.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.db import connection, transaction
from django.db.models import Max, Min
from django.utils import timezone

from portal.core.ranges import EPOCH
from portal.usage.aggregates import (
    COUNTS,
    PERCENTILE_FIELDS,
    RETENTION,
    WIDTHS,
    aggregate_python,
    aggregate_sql,
    floor_to,
)
from portal.usage.models import ERROR_Q, RollupWatermark, UsageErrorRollup, UsageRecord, UsageRollup
from portal.usage.percentiles import database_has_percentile_cont

# A row's recorded_at is stamped before its INSERT commits; a run may not see a row stamped a
# moment before it read. Each run looks this far behind its watermark again (recomputing a
# bucket twice is harmless).
LATE_COMMIT_GRACE = timedelta(seconds=60)
# Touched buckets closer than this many buckets are recomputed in one window (one query).
MERGE_GAP_BUCKETS = 30


@dataclass(frozen=True)
class RefreshResult:
    granularity: str
    windows: int  # queries run
    buckets: int  # buckets recomputed
    rows: int  # UsageRollup rows written


# -- writes -----------------------------------------------------------------------------------
def usage_rollup_refresh(*, now: datetime | None = None,
                         granularities: Iterable[str] = tuple(WIDTHS)) -> list[RefreshResult]:
    """Bring the roll-ups up to date with the ledger (what the every-minute beat task runs)."""
    now = now or timezone.now()
    return [_refresh_one(granularity=granularity, now=now) for granularity in granularities]


def usage_rollup_prune(*, now: datetime | None = None) -> dict[str, int]:
    """Delete roll-up rows older than their granularity's RETENTION; {granularity: rows deleted}."""
    now = now or timezone.now()
    deleted = {}
    for granularity, keep in RETENTION.items():
        if keep is None:
            continue
        cutoff = floor_to(now - keep, WIDTHS[granularity])
        deleted[str(granularity)], _ = UsageRollup.objects.filter(granularity=granularity, bucket__lt=cutoff).delete()
        UsageErrorRollup.objects.filter(granularity=granularity, bucket__lt=cutoff).delete()
    return deleted


def _refresh_one(*, granularity: str, now: datetime) -> RefreshResult:
    width = WIDTHS[granularity]
    keep = RETENTION[granularity]
    horizon = floor_to(now - keep, width) if keep is not None else None
    with transaction.atomic():
        # The row lock serialises concurrent runs of one granularity (two beats, a manual run).
        RollupWatermark.objects.get_or_create(granularity=granularity)
        mark = RollupWatermark.objects.select_for_update().get(granularity=granularity)
        ledger = UsageRecord.objects.all()
        if horizon is not None:
            ledger = ledger.filter(created_at__gte=horizon)
        if mark.recorded_until is None:
            # First run: every bucket the retention keeps.
            span = ledger.aggregate(first=Min("created_at"), seen=Max("recorded_at"))
            buckets = set()
            if span["first"] is not None:
                moment = floor_to(span["first"], width)
                while moment <= floor_to(now, width):
                    buckets.add(moment)
                    moment += width
            recorded_until = span["seen"]
        else:
            since = mark.recorded_until - LATE_COMMIT_GRACE
            buckets, seen = _touched_buckets(ledger.filter(recorded_at__gt=since), width)
            recorded_until = max(mark.recorded_until, seen) if seen is not None else mark.recorded_until
        current = floor_to(now, width)
        if horizon is None or current >= horizon:
            buckets.add(current)
        windows = _windows(sorted(buckets), width)
        rows = 0
        for start, end in windows:
            rows += _recompute(granularity=granularity, start=start, end=end)
        mark.recorded_until = recorded_until
        mark.covered_until = now
        mark.save(update_fields=["recorded_until", "covered_until", "updated_at"])
    return RefreshResult(granularity=str(granularity), windows=len(windows), buckets=len(buckets), rows=rows)


def _touched_buckets(records, width: timedelta) -> tuple[set[datetime], datetime | None]:
    """The buckets `records` fall in, and their newest recorded_at."""
    if database_has_percentile_cont():
        sql, params = records.values("created_at", "recorded_at").query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(
                f"SELECT date_bin(make_interval(secs => %s), created_at, %s), max(recorded_at) "
                f"FROM ({sql}) AS touched GROUP BY 1",
                [width.total_seconds(), EPOCH, *params])
            found = cursor.fetchall()
        return {bucket for bucket, _ in found}, max((seen for _, seen in found), default=None)
    buckets, seen = set(), None
    for created_at, recorded_at in records.values_list("created_at", "recorded_at").iterator():
        buckets.add(floor_to(created_at, width))
        seen = recorded_at if seen is None else max(seen, recorded_at)
    return buckets, seen


def _windows(buckets: list[datetime], width: timedelta) -> list[tuple[datetime, datetime]]:
    """Sorted bucket starts -> [start, end) windows; near neighbours share a window."""
    windows: list[list[datetime]] = []
    for bucket in buckets:
        if windows and bucket - windows[-1][1] <= MERGE_GAP_BUCKETS * width:
            windows[-1][1] = bucket + width
        else:
            windows.append([bucket, bucket + width])
    return [(start, end) for start, end in windows]


def _recompute(*, granularity: str, start: datetime, end: datetime) -> int:
    """Replace the roll-up rows of buckets [start, end) (aligned to the granularity)."""
    width = WIDTHS[granularity]
    UsageRollup.objects.filter(granularity=granularity, bucket__gte=start, bucket__lt=end).delete()
    _recompute_errors(granularity=granularity, start=start, end=end)
    if database_has_percentile_cont():
        select, params = aggregate_sql(width=width, start=start, end=end, filters={}, grouping_sets=True)
        columns = ["bucket", "dimension", "key", *COUNTS, *PERCENTILE_FIELDS]
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {UsageRollup._meta.db_table} (granularity, {', '.join(columns)}) "
                f"SELECT %s, {', '.join(columns)} FROM ({select}) AS aggregated",
                [granularity, *params])
            return cursor.rowcount
    rows = [UsageRollup(granularity=granularity, **row)
            for row in aggregate_python(width=width, start=start, end=end, filters={}, grouping_sets=True)]
    UsageRollup.objects.bulk_create(rows, batch_size=2000)
    return len(rows)


def _recompute_errors(*, granularity: str, start: datetime, end: datetime) -> None:
    """Replace the UsageErrorRollup rows of buckets [start, end): error rows counted by
    (bucket, tenant, status, code), read through the ledger's partial index on errors."""
    width = WIDTHS[granularity]
    UsageErrorRollup.objects.filter(granularity=granularity, bucket__gte=start, bucket__lt=end).delete()
    errors = UsageRecord.objects.filter(ERROR_Q, created_at__gte=start, created_at__lt=end)
    if database_has_percentile_cont():
        sql, params = errors.values("created_at", "tenant_id", "status_code", "error_code").query.sql_with_params()
        with connection.cursor() as cursor:
            cursor.execute(
                f"INSERT INTO {UsageErrorRollup._meta.db_table} (granularity, bucket, tenant_id, status_code, "
                "error_code, count) SELECT %s, date_bin(make_interval(secs => %s), created_at, %s), tenant_id, "
                f"status_code, error_code, count(*) FROM ({sql}) AS e GROUP BY 2, 3, 4, 5",
                [granularity, width.total_seconds(), EPOCH, *params])
        return
    counted: dict[tuple, int] = defaultdict(int)
    for created_at, tenant_id, status, code in errors.values_list("created_at", "tenant_id", "status_code",
                                                                  "error_code").iterator():
        counted[(floor_to(created_at.astimezone(UTC), width), tenant_id, status, code)] += 1
    UsageErrorRollup.objects.bulk_create([
        UsageErrorRollup(granularity=granularity, bucket=bucket, tenant_id=tenant_id, status_code=status,
                         error_code=code, count=n) for (bucket, tenant_id, status, code), n in counted.items()])

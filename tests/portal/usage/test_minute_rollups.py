"""Minute/hour/day roll-ups: every row equals percentile_cont over its own ledger rows; late rows,
retention, the Python twin and the beat entries."""

import random
from datetime import UTC, datetime, timedelta
from itertools import count

import pytest
from django.db.models import Count, Q

from portal.adapters.models import Adapter, AdapterVersion
from portal.tenants.services import tenant_create
from portal.usage import rollups
from portal.usage.aggregates import COUNTS, DIMENSION_COLUMNS, PERCENTILE_FIELDS, WIDTHS, floor_to
from portal.usage.models import (
    COMPLETED_Q,
    ERROR_Q,
    RollupWatermark,
    UsageErrorRollup,
    UsageRecord,
    UsageRollup,
)
from portal.usage.percentiles import PercentileCont, percentile_cont
from portal.usage.rollups import usage_rollup_prune, usage_rollup_refresh
from portal.usage.tasks import usage_rollup_prune_task, usage_rollup_refresh_task

pytestmark = pytest.mark.django_db

HOUR = datetime(2026, 11, 30, 9, tzinfo=UTC)  # the generated hour [09:00, 10:00)
AFTER = HOUR + timedelta(hours=1, seconds=30)  # when the roll-up runs
_ids = count()
# metric -> (ledger column, extra filter on completed requests)
COLD = Q(adapter_tier__in=["host", "disk"])
METRIC_ROWS = {
    "ttft": ("time_to_first_token_ms", Q()), "ttft_warm": ("time_to_first_token_ms", ~COLD),
    "ttft_cold": ("time_to_first_token_ms", COLD), "itl": ("inter_token_ms", Q()),
    "latency": ("latency_ms", Q()), "queue": ("queue_ms", Q()),
}


def generate_hour(*, start=HOUR, rows=900, seed=7, recorded_at=None):
    """`rows` ledger rows spread over [start, start + 1 h): 3 tenants on 3 plans, 4 models, 2
    versions and the base, 3 workers, warm and cold adapters, errors, disconnects, retries,
    missing timings and ties (values rounded to whole ms)."""
    rng = random.Random(seed)
    # t0 (free) owns the adapter, so only its rows have versions and adapter tiers.
    tenants = [tenant_create(slug=f"t{i}", name=f"T{i}") for i in range(3)]
    for tenant, plan in zip(tenants, ("free", "team", "enterprise"), strict=True):
        tenant.plan = plan
        tenant.save(update_fields=["plan"])
    adapter = Adapter.objects.create(tenant=tenants[0], name="bot")
    versions = [AdapterVersion.objects.create(adapter=adapter, number=n) for n in (1, 2)]
    records = []
    for _ in range(rows):
        created = start + timedelta(seconds=rng.uniform(0, 3599.999))
        tenant = rng.choice(tenants)
        version = rng.choice([*versions, None]) if tenant == tenants[0] else None  # t0's adapter
        tier = rng.choice(["device", "device", "host", "disk", ""]) if version else ""
        status = rng.choice([200] * 12 + [429, 502, 400])
        cold = tier in ("host", "disk")
        ttft = None if rng.random() < 0.05 else float(round(rng.lognormvariate(5, 0.8) + (2000 if cold else 0)))
        records.append(UsageRecord(
            request_id=f"gen-{next(_ids)}", tenant=tenant, model=rng.choice(["t0/bot", "t0/bot@v1", "base", "t1/x"]),
            adapter_version=version, worker_url=rng.choice(["http://w1:8001", "http://w2:8001", "http://w3:8001", ""]),
            adapter_tier=tier, status_code=status, error="" if status == 200 else "failed",
            error_code={200: "", 429: "rate_limit_exceeded", 502: "upstream_error", 400: "invalid_request_error"}[status],
            client_disconnected=rng.random() < 0.05, upstream_attempts=rng.choice([1, 1, 1, 2, 3]),
            prompt_tokens=rng.randrange(1, 500), completion_tokens=rng.randrange(0, 200),
            time_to_first_token_ms=ttft, inter_token_ms=None if rng.random() < 0.1 else float(rng.randrange(5, 60)),
            queue_ms=float(rng.randrange(0, 40)), latency_ms=float(rng.randrange(50, 9000)),
            created_at=created, finished_at=created, recorded_at=recorded_at or created + timedelta(seconds=1)))
    UsageRecord.objects.bulk_create(records)
    return tenants, versions


def _ledger_rows(rollup: UsageRollup):
    """The ledger rows a roll-up row stands for."""
    width = WIDTHS[rollup.granularity]
    records = UsageRecord.objects.filter(created_at__gte=rollup.bucket, created_at__lt=rollup.bucket + width)
    if rollup.dimension != "all":
        column = DIMENSION_COLUMNS[rollup.dimension]
        records = records.filter(**{f"{column}__isnull": True}) if rollup.key == "" and rollup.dimension == "version" \
            else records.filter(**{column: rollup.key})
    return records


def test_every_minute_row_equals_percentile_cont_on_its_own_ledger_rows(tenant):
    generate_hour()
    usage_rollup_refresh(now=AFTER)

    minute_rows = list(UsageRollup.objects.filter(granularity="minute"))
    assert {row.bucket for row in minute_rows} == {HOUR + timedelta(minutes=m) for m in range(60)}
    # every group of every bucket: all, 3 tenants, 4 models, 3 versions (2 + base), 4 workers
    assert {row.dimension for row in minute_rows} == {"all", "tenant", "model", "version", "worker"}
    assert len({(r.dimension, r.key) for r in minute_rows}) == 1 + 3 + 4 + 3 + 4
    checked = 0
    for row in minute_rows:
        records = _ledger_rows(row)
        counts = records.aggregate(requests=Count("id"), completed=Count("id", filter=COMPLETED_Q),
                                   errors=Count("id", filter=ERROR_Q), cold=Count("id", filter=COLD),
                                   retried=Count("id", filter=Q(upstream_attempts__gt=1)))
        assert (row.requests, row.completed, row.errors, row.cold_requests, row.retried) == (
            counts["requests"], counts["completed"], counts["errors"], counts["cold"], counts["retried"])
        completed = records.filter(COMPLETED_Q)
        for metric, (column, subset) in METRIC_ROWS.items():
            rows = completed.filter(subset)
            direct = rows.aggregate(**{p: PercentileCont(column, f) for p, f in (("p50", .5), ("p95", .95), ("p99", .99))})
            values = list(rows.values_list(column, flat=True))
            for p, fraction in (("p50", .5), ("p95", .95), ("p99", .99)):
                stored = getattr(row, f"{metric}_{p}_ms")
                assert stored == pytest.approx(direct[p]), (row, metric, p)
                assert stored == pytest.approx(percentile_cont(values, fraction)), (row, metric, p)
                checked += 1
    assert checked == len(minute_rows) * 18
    # errors by (minute, tenant, status, code), counted straight from the ledger
    direct = {(floor_to(r.created_at, timedelta(minutes=1)), r.tenant_id, r.status_code, r.error_code): 0
              for r in UsageRecord.objects.filter(ERROR_Q)}
    for r in UsageRecord.objects.filter(ERROR_Q):
        direct[(floor_to(r.created_at, timedelta(minutes=1)), r.tenant_id, r.status_code, r.error_code)] += 1
    assert {(e.bucket, e.tenant_id, e.status_code, e.error_code): e.count
            for e in UsageErrorRollup.objects.filter(granularity="minute")} == direct
    # the hour row of "all" is over the whole hour, not an average of minutes
    hour = UsageRollup.objects.get(granularity="hour", dimension="all")
    all_ttft = UsageRecord.objects.filter(COMPLETED_Q).values_list("time_to_first_token_ms", flat=True)
    assert hour.requests == 900
    assert hour.ttft_p95_ms == pytest.approx(percentile_cont(all_ttft, 0.95))


def test_slo_met_counts_completed_requests_within_their_tenants_target():
    tenants, _ = generate_hour()
    tenants[1].ttft_p95_target_ms = 300  # the team plan's 1000 ms, overridden
    tenants[1].save()
    usage_rollup_refresh(now=AFTER)
    for tenant, target in zip(tenants, (2000, 300, 500), strict=True):
        row = UsageRollup.objects.get(granularity="hour", dimension="tenant", key=str(tenant.pk))
        completed = UsageRecord.objects.filter(COMPLETED_Q, tenant=tenant, time_to_first_token_ms__isnull=False)
        assert row.ttft_requests == completed.count()
        assert row.slo_met == completed.filter(time_to_first_token_ms__lte=target).count()
        assert 0 < row.slo_met < row.ttft_requests


def test_the_python_twin_writes_the_same_rows(monkeypatch):
    generate_hour(rows=300)
    usage_rollup_refresh(now=AFTER)
    fields = ["granularity", "bucket", "dimension", "key", *COUNTS, *PERCENTILE_FIELDS]
    in_sql = sorted(UsageRollup.objects.values_list(*fields))
    errors_in_sql = sorted(UsageErrorRollup.objects.values_list(
        "granularity", "bucket", "tenant_id", "status_code", "error_code", "count"))
    assert len(errors_in_sql) > 60
    UsageRollup.objects.all().delete()
    UsageErrorRollup.objects.all().delete()
    RollupWatermark.objects.all().delete()
    monkeypatch.setattr(rollups, "database_has_percentile_cont", lambda: False)
    usage_rollup_refresh(now=AFTER)
    in_python = sorted(UsageRollup.objects.values_list(*fields))
    error_fields = ["granularity", "bucket", "tenant_id", "status_code", "error_code", "count"]
    assert sorted(UsageErrorRollup.objects.values_list(*error_fields)) == errors_in_sql
    assert len(in_python) == len(in_sql) > 60
    for python_row, sql_row in zip(in_python, in_sql, strict=True):
        assert python_row[:4 + len(COUNTS)] == sql_row[:4 + len(COUNTS)]
        assert python_row[4 + len(COUNTS):] == pytest.approx(sql_row[4 + len(COUNTS):])


def test_late_rows_are_picked_up_by_the_next_run_and_nothing_else_moves(tenant):
    generate_hour(rows=200)
    usage_rollup_refresh(now=AFTER)
    minute = HOUR + timedelta(minutes=7)
    def minute_rows():
        return {(r.bucket, r.dimension, r.key): (r.requests, r.ttft_p95_ms)
                for r in UsageRollup.objects.filter(granularity="minute").exclude(bucket=minute)}

    before = minute_rows()
    old = UsageRollup.objects.get(granularity="minute", dimension="all", bucket=minute).requests
    mark = RollupWatermark.objects.get(granularity="minute").recorded_until
    # A spool replay: rows that started at 09:07 land after the run; one stamped just before the
    # watermark (its INSERT was still committing when the run read) is found too.
    for recorded_at in (AFTER + timedelta(minutes=5), mark - timedelta(seconds=20)):
        UsageRecord.objects.create(request_id=f"late-{recorded_at}", tenant=tenant, model="late",
                                   created_at=minute + timedelta(seconds=3), recorded_at=recorded_at, latency_ms=5.0)

    results = {r.granularity: r for r in usage_rollup_refresh(now=AFTER + timedelta(minutes=6))}

    assert UsageRollup.objects.get(granularity="minute", dimension="all", bucket=minute).requests == old + 2
    assert UsageRollup.objects.get(granularity="minute", dimension="model", key="late").requests == 2
    assert UsageRollup.objects.get(granularity="hour", dimension="all", bucket=HOUR).requests == 202
    assert UsageRollup.objects.get(granularity="day", dimension="all").requests == 202
    # only the touched minutes (09:07, the grace's 09:59 rows and now) were recomputed
    assert results["minute"].buckets <= 4
    assert minute_rows() == before


def test_a_second_run_without_new_rows_changes_nothing():
    generate_hour(rows=200)
    usage_rollup_refresh(now=AFTER)
    fields = ["granularity", "bucket", "dimension", "key", *COUNTS, *PERCENTILE_FIELDS]
    first = sorted(UsageRollup.objects.values_list(*fields))
    usage_rollup_refresh(now=AFTER + timedelta(minutes=1))
    assert sorted(UsageRollup.objects.values_list(*fields)) == first


def test_retention_deletes_only_rows_past_it(tenant):
    now = datetime(2026, 12, 1, 12, tzinfo=UTC)

    def row(granularity, age):
        return UsageRollup(granularity=granularity, dimension="all", key="", requests=1,
                           bucket=floor_to(now - age, WIDTHS[granularity]))

    UsageRollup.objects.bulk_create([
        row("minute", timedelta(days=3, minutes=2)), row("minute", timedelta(days=2, hours=23)),
        row("hour", timedelta(days=401)), row("hour", timedelta(days=399)),
        row("day", timedelta(days=2000)),
    ])
    assert usage_rollup_prune(now=now) == {"minute": 1, "hour": 1}
    kept = sorted((r.granularity, (now - r.bucket).days) for r in UsageRollup.objects.all())
    assert kept == [("day", 2000), ("hour", 399), ("minute", 2)]


def test_minute_rows_past_retention_are_not_rebuilt():
    generate_hour(rows=50)
    usage_rollup_refresh(now=HOUR + timedelta(days=4))
    assert not UsageRollup.objects.filter(granularity="minute", bucket__lt=HOUR + timedelta(days=1)).exists()
    assert UsageRollup.objects.get(granularity="hour", dimension="all").requests == 50


def test_windows_merge_near_buckets_and_split_far_ones():
    minute = timedelta(minutes=1)
    buckets = [HOUR, HOUR + minute, HOUR + 10 * minute, HOUR + 200 * minute]
    assert rollups._windows(buckets, minute) == [(HOUR, HOUR + 11 * minute),
                                                 (HOUR + 200 * minute, HOUR + 201 * minute)]


def test_the_tasks_run_and_the_beat_entries_reach_the_celery_app():
    from portal.celery import app

    generate_hour(rows=20)
    assert usage_rollup_refresh_task()["minute"] >= 1  # the current minute at least
    assert set(usage_rollup_prune_task()) == {"minute", "hour"}
    assert app.conf.beat_schedule["usage-rollup-refresh"]["schedule"] == 60.0
    assert app.conf.beat_schedule["usage-rollup-prune"]["task"] == "portal.usage.tasks.usage_rollup_prune_task"

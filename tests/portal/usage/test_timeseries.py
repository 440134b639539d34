"""The dashboards' reads over a TimeRange: latency per bucket (roll-ups, the ledger, the live
tail), pickers, errors by status/code with retries, and per-tenant TTFT objectives."""

from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_UP, Decimal
from itertools import count

import pytest
from django.utils import timezone

from portal.core.exceptions import InvalidInput
from portal.core.ranges import TimeRange, parse_range
from portal.tenants.services import tenant_create
from portal.usage import timeseries
from portal.usage.aggregates import floor_to
from portal.usage.models import COMPLETED_Q, UsageRecord
from portal.usage.percentiles import percentile_cont
from portal.usage.rollups import usage_rollup_refresh
from portal.usage.timeseries import (
    error_series,
    latency_filters,
    latency_series,
    slo_summary,
    usage_totals,
)
from tests.portal.usage.test_minute_rollups import generate_hour

pytestmark = pytest.mark.django_db
MINUTE = timedelta(minutes=1)
_ids = count()


def _last_hour():
    """An hour of generated rows ending a minute ago, rolled up; (tenants, versions, now)."""
    now = timezone.now()
    start = floor_to(now, MINUTE) - timedelta(hours=1)
    tenants, versions = generate_hour(start=start, rows=600)
    UsageRecord.objects.filter(created_at__gte=now).delete()  # nothing from the future
    usage_rollup_refresh(now=now)
    return tenants, versions, now


def _row(tenant, at, **fields):
    fields.setdefault("latency_ms", 100.0)
    return UsageRecord.objects.create(request_id=f"ts-{next(_ids)}", tenant=tenant, model=fields.pop("model", "m"),
                                      created_at=at, finished_at=at, **fields)


def test_a_live_hour_reads_minute_rollups_and_the_ledger_after_the_last_run():
    tenants, _, now = _last_hour()
    # a request after the roll-up ran: read from the ledger at query time
    _row(tenants[0], timezone.now(), time_to_first_token_ms=12345.0, adapter_tier="disk")
    series = latency_series(time_range=parse_range({"range": "1h"}, now=timezone.now()))

    assert series["source"] == "rollup:minute" and series["bucket"] == "1m"
    assert series["live_from"] == floor_to(now, MINUTE).isoformat()
    assert len(series["buckets"]) in (60, 61)
    assert series["requests"] == UsageRecord.objects.filter(created_at__gte=series["buckets"][0]["start"]).count()
    last = series["buckets"][-1]
    assert last["cold_requests"] >= 1 and last["ttft_cold_ms"]["p99"] is not None
    # a rolled-up minute: the exact percentile of that minute's completed rows
    bucket = series["buckets"][30]
    start = datetime.fromisoformat(bucket["start"])
    ttfts = UsageRecord.objects.filter(COMPLETED_Q, created_at__gte=start, created_at__lt=start + MINUTE) \
        .values_list("time_to_first_token_ms", flat=True)
    assert bucket["ttft_ms"]["p95"] == pytest.approx(percentile_cont(ttfts, 0.95))


def test_two_filters_read_the_ledger_and_agree_with_the_rollup_path(monkeypatch):
    tenants, versions, now = _last_hour()
    time_range = TimeRange(start=floor_to(now, MINUTE) - timedelta(hours=1), end=floor_to(now, MINUTE),
                           bucket=MINUTE, name="custom")
    one = latency_series(time_range=time_range, version=versions[0].pk)
    # every row of version 1 belongs to t0: version + tenant selects the same rows, and the
    # tenant is implied by the version, so the pair reads the version's roll-ups too ...
    implied = latency_series(time_range=time_range, version=versions[0].pk, tenant=tenants[0].slug)
    assert (implied["source"], implied["buckets"]) == ("rollup:minute", one["buckets"])
    assert latency_series(time_range=time_range, model="t0/bot", tenant=tenants[0].slug)["source"] == "rollup:minute"
    assert latency_series(time_range=time_range, model="base", tenant=tenants[0].slug)["source"] == "ledger"
    # ... and the ledger's answer for two filters is the same
    monkeypatch.setattr(timeseries, "_without_implied", lambda filters: filters)
    two = latency_series(time_range=time_range, version=versions[0].pk, tenant=tenants[0].slug)

    assert (one["source"], two["source"]) == ("rollup:minute", "ledger")
    assert one["requests"] == two["requests"] > 0
    for a, b in zip(one["buckets"], two["buckets"], strict=True):
        assert a["start"] == b["start"]
        for metric in ("ttft_ms", "ttft_warm_ms", "ttft_cold_ms", "itl_ms", "latency_ms", "queue_ms"):
            assert a[metric] == pytest.approx(b[metric]), (a["start"], metric)
        assert (a["requests"], a["completed"], a["cold_requests"]) == (b["requests"], b["completed"], b["cold_requests"])


def test_odd_buckets_come_from_the_ledger_when_short_and_snap_to_a_granularity_when_long():
    _last_hour()
    now = timezone.now()
    six_hours = latency_series(time_range=parse_range({"range": "6h"}, now=now))
    assert (six_hours["bucket"], six_hours["source"]) == ("5m", "ledger")
    five = [b for b in six_hours["buckets"] if b["requests"]]
    start = datetime.fromisoformat(five[1]["start"])
    latencies = UsageRecord.objects.filter(COMPLETED_Q, created_at__gte=start,
                                           created_at__lt=start + timedelta(minutes=5)).values_list("latency_ms", flat=True)
    assert five[1]["latency_ms"]["p50"] == pytest.approx(percentile_cont(latencies, 0.5))

    day = latency_series(time_range=parse_range({"range": "24h", "bucket": "15m"}, now=now))
    assert (day["range"]["bucket"], day["bucket"], day["source"]) == ("15m", "1h", "rollup:hour")
    assert day["requests"] == UsageRecord.objects.count()
    week = latency_series(time_range=parse_range({"range": "7d", "bucket": "6h"}, now=now))
    assert (week["range"]["bucket"], week["bucket"], week["source"]) == ("6h", "1h", "rollup:hour")
    assert week["requests"] == UsageRecord.objects.count()
    # By default a long range asks for a granularity the roll-ups have, and gets it.
    default_day = latency_series(time_range=parse_range({"range": "24h"}, now=now))
    assert (default_day["range"]["bucket"], default_day["bucket"]) == ("1h", "1h")
    month = latency_series(time_range=parse_range({"range": "30d"}, now=now))
    assert (month["range"]["bucket"], month["bucket"], len(month["buckets"])) == ("1d", "1d", 31)
    assert month["requests"] == UsageRecord.objects.count()


def test_filters_list_what_was_used_and_bad_filters_are_refused():
    tenants, versions, _ = _last_hour()
    pickers = latency_filters(time_range=parse_range({"range": "1h"}, now=timezone.now()))
    assert pickers["tenants"] == ["t0", "t1", "t2"]
    assert pickers["models"] == ["base", "t0/bot", "t0/bot@v1", "t1/x"]
    assert pickers["versions"] == [{"id": v.pk, "label": f"t0/bot@v{v.number}"} for v in versions]
    assert pickers["workers"] == ["http://w1:8001", "http://w2:8001", "http://w3:8001"]

    time_range = parse_range({"range": "15m"}, now=timezone.now())
    with pytest.raises(InvalidInput, match="tenant: no tenant 'nobody'"):
        latency_series(time_range=time_range, tenant="nobody")
    with pytest.raises(InvalidInput, match="version"):
        latency_series(time_range=time_range, version="1; DROP TABLE")
    with pytest.raises(InvalidInput, match="tenant"):
        error_series(time_range=time_range, tenant="nobody")
    assert UsageRecord.objects.count() > 0  # nothing lost


def test_an_empty_range_has_empty_buckets():
    series = latency_series(time_range=parse_range({"range": "15m"}, now=timezone.now()))
    assert series["requests"] == 0 and series["source"] == "ledger"  # never rolled up yet
    assert all(b["ttft_ms"] == {"p50": None, "p95": None, "p99": None} for b in series["buckets"])


def test_errors_by_status_and_code_with_retries_per_bucket_and_tenant(tenant):
    other = tenant_create(slug="other", name="Other")
    now = timezone.now()
    base = floor_to(now, MINUTE) - 10 * MINUTE
    for minute, status, code, who in ((1, 429, "rate_limit_exceeded", tenant), (1, 429, "rate_limit_exceeded", tenant),
                                      (1, 429, "insufficient_quota", other), (3, 502, "upstream_error", other)):
        _row(who, base + minute * MINUTE, status_code=status, error="x", error_code=code)
    _row(tenant, base + 3 * MINUTE, upstream_attempts=2)
    _row(tenant, base + 3 * MINUTE, upstream_attempts=1)
    usage_rollup_refresh(now=base + 4 * MINUTE)  # minutes 1 and 3 rolled up; minute 8 comes later
    _row(other, base + 8 * MINUTE, status_code=502, error="x", error_code="upstream_error", upstream_attempts=3)

    errors = error_series(time_range=parse_range({"range": "15m"}, now=now))
    index = {start: i for i, start in enumerate(errors["buckets"])}
    at = {m: index[(base + m * MINUTE).isoformat()] for m in (1, 3, 8)}
    series = {(s["status"], s["code"]): s["counts"] for s in errors["series"]}
    assert series[(429, "rate_limit_exceeded")][at[1]] == 2
    assert series[(429, "insufficient_quota")][at[1]] == 1
    assert [series[(502, "upstream_error")][at[m]] for m in (1, 3, 8)] == [0, 1, 1]
    assert [errors["retries"][at[m]] for m in (1, 3, 8)] == [0, 1, 1]
    assert [errors["requests"][at[m]] for m in (1, 3, 8)] == [3, 3, 1]
    assert sum(errors["errors"]) == 5
    by_tenant = {t["slug"]: t for t in errors["by_tenant"]}
    assert by_tenant["other"] == {"slug": "other", "requests": 3, "errors": 3,
                                  "by_code": {"502 upstream_error": 2, "429 insufficient_quota": 1}}
    assert by_tenant["acme"]["requests"] == 4 and by_tenant["acme"]["by_code"] == {"429 rate_limit_exceeded": 2}

    only = error_series(time_range=parse_range({"range": "15m"}, now=now), tenant="acme")
    assert [t["slug"] for t in only["by_tenant"]] == ["acme"]
    assert sum(only["requests"]) == 4 and sum(only["retries"]) == 1


def test_slo_share_and_which_tenants_miss_their_target_now(tenant):
    slow = tenant_create(slug="slow", name="Slow")
    slow.plan = "enterprise"  # 500 ms
    slow.save()
    tenant.ttft_p95_target_ms = 800  # free plan's 2000, overridden
    tenant.save()
    now = timezone.now()
    an_hour_ago = now - timedelta(minutes=50)
    for i in range(10):  # an hour ago: acme fast, slow fast
        _row(tenant, an_hour_ago + i * MINUTE, time_to_first_token_ms=100.0 + i)
        _row(slow, an_hour_ago + i * MINUTE, time_to_first_token_ms=200.0)
    usage_rollup_refresh(now=now - timedelta(minutes=20))
    for i in range(4):  # the last minutes: slow is slow, acme at 900 ms over its 800
        _row(slow, now - timedelta(minutes=5) + i * MINUTE, time_to_first_token_ms=1500.0)
        _row(tenant, now - timedelta(minutes=5) + i * MINUTE, time_to_first_token_ms=300.0 if i else 900.0)
    _row(slow, now - MINUTE, status_code=502, error="x", time_to_first_token_ms=9999.0)  # not completed

    summary = slo_summary(time_range=parse_range({"range": "1h"}, now=timezone.now()))
    by_slug = {t["slug"]: t for t in summary["tenants"]}
    assert summary["window_minutes"] == 15 and summary["p95_over_range"] is True
    assert by_slug["slow"] == {
        "slug": "slow", "plan": "enterprise", "target_ms": 500, "target_source": "plan", "requests": 15,
        "completed": 14, "met": 10, "share": pytest.approx(10 / 14),
        "p95_ms": pytest.approx(percentile_cont([200.0] * 10 + [1500.0] * 4, 0.95)),
        "p95_now_ms": pytest.approx(1500.0), "missing_now": True}
    acme = by_slug["acme"]
    assert (acme["target_ms"], acme["target_source"], acme["completed"], acme["met"]) == (800, "tenant", 14, 13)
    assert acme["p95_now_ms"] == pytest.approx(percentile_cont([900.0, 300.0, 300.0, 300.0], 0.95))
    assert acme["missing_now"] is True
    assert [t["slug"] for t in summary["tenants"]] == ["slow", "acme"]  # missing, lowest share first

    tenant.ttft_p95_target_ms = None  # back to the plan's 2000 ms: met now
    tenant.save()
    acme = {t["slug"]: t for t in slo_summary(time_range=parse_range({"range": "1h"}, now=timezone.now()))["tenants"]}["acme"]
    assert (acme["target_ms"], acme["target_source"], acme["missing_now"]) == (2000, "plan", False)
    week = slo_summary(time_range=parse_range({"range": "7d"}, now=timezone.now()))
    assert week["p95_over_range"] is False and all(t["p95_ms"] is None for t in week["tenants"])


def test_ranges_older_than_minute_retention_read_the_ledger(tenant):
    old = datetime(2026, 1, 5, 10, tzinfo=UTC)
    _row(tenant, old + MINUTE, time_to_first_token_ms=50.0)
    usage_rollup_refresh()
    series = latency_series(time_range=TimeRange(start=old, end=old + timedelta(hours=1), bucket=MINUTE, name="custom"))
    assert series["source"] == "ledger" and series["requests"] == 1


def test_counts_over_days_sum_day_hour_and_minute_rows_and_the_ledger_exactly(tenant):
    """Three days of rows up to now: 1d and 6h buckets and per-tenant totals, summed from day,
    hour and minute roll-ups and the live tail, equal counts taken straight from the ledger."""
    other = tenant_create(slug="other", name="Other")
    now = timezone.now()
    rows = [UsageRecord(request_id=f"days-{i}", tenant=(tenant, other)[i % 2], model="m", latency_ms=1.0,
                        status_code=(200, 200, 200, 502)[i % 4], error="" if i % 4 != 3 else "x",
                        upstream_attempts=1 + (i % 5 == 0), time_to_first_token_ms=float(i % 3000),
                        created_at=now - timedelta(minutes=7 * i + 1), finished_at=now)
            for i in range(600)]  # every 7 minutes for 70 hours
    UsageRecord.objects.bulk_create(rows)
    usage_rollup_refresh(now=now - timedelta(minutes=30))
    _row(tenant, timezone.now(), upstream_attempts=4)  # after the run: the ledger's

    for bucket in ("1d", "6h"):
        errors = error_series(time_range=parse_range({"range": "7d", "bucket": bucket}, now=timezone.now()))
        width = timedelta(days=1) if bucket == "1d" else timedelta(hours=6)
        for i, (start, requests, retries, failed) in enumerate(zip(errors["buckets"], errors["requests"],
                                                                   errors["retries"], errors["errors"], strict=True)):
            assert sum(series["counts"][i] for series in errors["series"]) == failed
            records = UsageRecord.objects.filter(created_at__gte=start,
                                                 created_at__lt=datetime.fromisoformat(start) + width)
            assert (requests, retries, failed) == (records.count(), records.filter(upstream_attempts__gt=1).count(),
                                                   records.filter(status_code__gte=400).count()), (bucket, start)
        assert {t["slug"]: t["requests"] for t in errors["by_tenant"]} == {"acme": 301, "other": 300}
        assert {t["slug"]: t["by_code"] for t in errors["by_tenant"]} == {"acme": {}, "other": {"502": 150}}
    slo = slo_summary(time_range=parse_range({"range": "7d"}, now=timezone.now()))
    acme = {t["slug"]: t for t in slo["tenants"]}["acme"]
    completed = UsageRecord.objects.filter(COMPLETED_Q, tenant=tenant, time_to_first_token_ms__isnull=False)
    assert (acme["completed"], acme["met"]) == (completed.count(),
                                                completed.filter(time_to_first_token_ms__lte=2000).count())


def test_usage_totals_per_tenant_equal_the_ledger_and_price_tokens_at_the_plan(tenant):
    team = tenant_create(slug="team", name="Team")
    team.plan = "team"
    team.save()
    now = timezone.now()
    UsageRecord.objects.bulk_create([
        UsageRecord(request_id=f"tot-{i}", tenant=(tenant, team)[i % 2], model="m", latency_ms=1.0,
                    prompt_tokens=1000 + i, completion_tokens=i, client_disconnected=i % 9 == 0,
                    status_code=429 if i % 10 == 1 else 200, error="" if i % 10 != 1 else "limited",
                    created_at=now - timedelta(minutes=11 * i + 1), finished_at=now)
        for i in range(400)])  # every 11 minutes for 73 hours
    usage_rollup_refresh(now=now - timedelta(minutes=5))
    _row(team, timezone.now(), prompt_tokens=7, status_code=429, error="x")  # the live tail

    totals = {t["slug"]: t for t in usage_totals(time_range=parse_range({"range": "7d"}, now=timezone.now()))["tenants"]}
    for who in (tenant, team):
        records = UsageRecord.objects.filter(tenant=who)
        row = totals[who.slug]
        assert (row["requests"], row["errors"], row["quota_rejections"], row["disconnects"]) == (
            records.count(), records.filter(status_code__gte=400).count(), records.filter(status_code=429).count(),
            records.filter(client_disconnected=True).count())
        assert row["prompt_tokens"] == sum(records.values_list("prompt_tokens", flat=True))
    # team: 0.08 / 0.24 USD per million prompt / completion tokens
    team_row = totals["team"]
    expected = (Decimal(team_row["prompt_tokens"]) * Decimal("0.08")
                + Decimal(team_row["completion_tokens"]) * Decimal("0.24")) / 1_000_000
    assert team_row["spend"] == str(expected.quantize(Decimal("0.01"), rounding=ROUND_HALF_UP))

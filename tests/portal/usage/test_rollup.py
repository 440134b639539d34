"""usage_rollup_day rebuilds DailyUsage from the ledger: right numbers, UTC days, idempotent."""

from datetime import UTC, date, datetime, timedelta

import pytest

from portal.adapters.models import Adapter, AdapterVersion
from portal.tenants.services import tenant_create
from portal.usage.models import DailyUsage
from portal.usage.percentiles import percentile_cont
from portal.usage.services import usage_rollup_day
from portal.usage.tasks import usage_rollup_task

pytestmark = pytest.mark.django_db

DAY = date(2025, 3, 10)
NOON = datetime(2025, 3, 10, 12, tzinfo=UTC)


def _rows():
    fields = [f.attname for f in DailyUsage._meta.concrete_fields if f.name not in ("id", "updated_at")]
    return sorted(DailyUsage.objects.values_list(*fields))


def test_one_row_per_tenant_and_model_with_counts_and_token_sums(record, tenant):
    other = tenant_create(slug="other", name="Other")
    record(prompt_tokens=10, completion_tokens=5, latency_ms=100, time_to_first_token_ms=10)
    record(prompt_tokens=20, completion_tokens=7, latency_ms=300, time_to_first_token_ms=30)
    record(prompt_tokens=3, completion_tokens=0, status_code=502, error="worker died", latency_ms=9)
    record(prompt_tokens=4, completion_tokens=2, client_disconnected=True, latency_ms=50, finish_reason="abort")
    record(model="base", prompt_tokens=1, completion_tokens=1, latency_ms=5)
    record(tenant=other, prompt_tokens=100, completion_tokens=100, latency_ms=1)

    assert usage_rollup_day(day=DAY) == 3

    bot = DailyUsage.objects.get(tenant=tenant, model="acme/bot")
    assert (bot.date, bot.requests, bot.errors, bot.disconnects) == (DAY, 4, 1, 1)
    assert (bot.prompt_tokens, bot.completion_tokens, bot.total_tokens) == (37, 14, 51)
    # percentiles over completed requests only (the error and the disconnect left out)
    assert bot.latency_p50_ms == pytest.approx(200.0)
    assert bot.latency_p99_ms == pytest.approx(100 + 200 * 0.99)
    assert bot.ttft_p95_ms == pytest.approx(10 + 20 * 0.95)
    base = DailyUsage.objects.get(tenant=tenant, model="base")
    assert (base.requests, base.prompt_tokens, base.latency_p50_ms) == (1, 1, 5.0)
    assert DailyUsage.objects.get(tenant=other).prompt_tokens == 100


def test_percentiles_match_percentile_cont_in_python(record):
    latencies = [float(value) for value in (7, 1, 250, 13, 13, 90, 4, 1200, 61, 33, 2, 18)]
    ttfts = [None, 1.5, 2.5, 40.0, 3.0, None, 8.0, 9.5, 100.0, 0.5, 7.0, 6.0]
    for latency, ttft in zip(latencies, ttfts, strict=True):
        record(latency_ms=latency, time_to_first_token_ms=ttft)

    usage_rollup_day(day=DAY)

    row = DailyUsage.objects.get()
    for p in (50, 95, 99):
        assert getattr(row, f"latency_p{p}_ms") == pytest.approx(percentile_cont(latencies, p / 100))
        assert getattr(row, f"ttft_p{p}_ms") == pytest.approx(percentile_cont(ttfts, p / 100))


def test_percentile_cont_in_python_interpolates_like_postgresql():
    assert percentile_cont([], 0.5) is None
    assert percentile_cont([None], 0.5) is None
    assert percentile_cont([5.0], 0.99) == 5.0
    assert percentile_cont([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile_cont([10.0, 0.0], 0.95) == pytest.approx(9.5)


def test_no_completed_request_leaves_percentiles_empty(record):
    record(status_code=429, error="rate_limit_exceeded", latency_ms=1)

    usage_rollup_day(day=DAY)

    row = DailyUsage.objects.get()
    assert (row.requests, row.errors, row.latency_p50_ms, row.ttft_p99_ms) == (1, 1, None, None)


def test_days_are_utc_days_of_the_request_start(record):
    record(created_at=datetime(2025, 3, 9, 23, 59, 59, 999999, tzinfo=UTC), prompt_tokens=1)
    record(created_at=datetime(2025, 3, 10, 0, 0, tzinfo=UTC), prompt_tokens=10)
    record(created_at=datetime(2025, 3, 10, 23, 59, 59, tzinfo=UTC), prompt_tokens=100)
    record(created_at=datetime(2025, 3, 11, 0, 0, tzinfo=UTC), prompt_tokens=1000)
    # 01:00 in UTC+02:00 is still March 9th in UTC
    record(created_at=datetime(2025, 3, 10, 1, 0, tzinfo=UTC) + timedelta(hours=-2), prompt_tokens=10000)

    usage_rollup_day(day=DAY)

    assert DailyUsage.objects.get().prompt_tokens == 110


def test_running_twice_gives_the_same_rows_and_later_records_are_picked_up(record):
    record(prompt_tokens=10, latency_ms=10)
    record(model="base", prompt_tokens=1, latency_ms=20)

    usage_rollup_day(day=DAY)
    first = _rows()
    usage_rollup_day(day=DAY)

    assert _rows() == first and len(first) == 2

    record(prompt_tokens=5, latency_ms=30)
    usage_rollup_day(day=DAY)

    assert DailyUsage.objects.get(model="acme/bot").prompt_tokens == 15
    assert DailyUsage.objects.count() == 2


def test_groups_gone_from_the_ledger_lose_their_rollup_and_other_days_are_untouched(record, tenant):
    record(prompt_tokens=10)
    record(created_at=NOON + timedelta(days=1), prompt_tokens=7)
    usage_rollup_day(day=DAY)
    usage_rollup_day(day=DAY + timedelta(days=1))
    DailyUsage.objects.create(date=DAY, tenant=tenant, model="gone", requests=3)

    usage_rollup_day(day=DAY)

    assert sorted(DailyUsage.objects.values_list("date", "model", "prompt_tokens")) == [
        (DAY, "acme/bot", 10),
        (DAY + timedelta(days=1), "acme/bot", 7),
    ]


def test_adapter_version_is_kept_when_the_day_used_one(record, tenant):
    adapter = Adapter.objects.create(tenant=tenant, name="bot")
    v1 = AdapterVersion.objects.create(adapter=adapter, number=1)
    v2 = AdapterVersion.objects.create(adapter=adapter, number=2)
    record(model="acme/bot@v1", adapter_version=v1)
    record(model="acme/bot@v1", adapter_version=v1)
    record(model="acme/bot", adapter_version=v1)
    record(model="acme/bot", adapter_version=v2)
    record(model="base")

    usage_rollup_day(day=DAY)

    versions = dict(DailyUsage.objects.values_list("model", "adapter_version"))
    assert versions == {"acme/bot@v1": v1.pk, "acme/bot": None, "base": None}


def test_an_empty_day_has_no_rows(record):
    record(created_at=NOON - timedelta(days=3))

    assert usage_rollup_day(day=DAY) == 0
    assert not DailyUsage.objects.exists()


def test_the_task_rolls_up_a_given_day_or_yesterday_and_today(record):
    record(prompt_tokens=1)

    assert usage_rollup_task.apply(args=[DAY.isoformat()]).get() == [DAY.isoformat()]
    assert DailyUsage.objects.get().prompt_tokens == 1

    today = datetime.now(UTC).date()
    record(created_at=datetime.now(UTC), prompt_tokens=2)
    record(created_at=datetime.now(UTC) - timedelta(days=1), prompt_tokens=3)

    assert usage_rollup_task() == [(today - timedelta(days=1)).isoformat(), today.isoformat()]
    assert sorted(DailyUsage.objects.values_list("prompt_tokens", flat=True)) == [1, 2, 3]


def test_the_hourly_beat_entry_reaches_the_celery_app():
    from portal.celery import app

    entry = app.conf.beat_schedule["usage-rollup-hourly"]
    assert entry["task"] == usage_rollup_task.name
    assert entry["schedule"].minute == {5}

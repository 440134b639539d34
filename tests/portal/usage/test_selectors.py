"""Dashboard reads: per day and per model from the rollups, percentiles from the ledger."""

from datetime import UTC, date, datetime, timedelta

import pytest

from portal.core.exceptions import InvalidInput
from portal.tenants.services import tenant_create
from portal.usage.percentiles import percentile_cont
from portal.usage.selectors import (
    latency_percentiles,
    usage_by_day,
    usage_by_model,
    usage_record_list,
)
from portal.usage.services import usage_rollup_day

pytestmark = pytest.mark.django_db

DAY = date(2025, 3, 10)


def _at(day: date, hour: int = 12) -> datetime:
    return datetime(day.year, day.month, day.day, hour, tzinfo=UTC)


@pytest.fixture
def usage(record, tenant):
    other = tenant_create(slug="other", name="Other")
    record(created_at=_at(DAY), prompt_tokens=10, completion_tokens=1, latency_ms=100, time_to_first_token_ms=10)
    record(created_at=_at(DAY), model="base", prompt_tokens=5, completion_tokens=5, latency_ms=200)
    record(created_at=_at(DAY + timedelta(days=2)), prompt_tokens=100, completion_tokens=50, latency_ms=300,
           time_to_first_token_ms=30)
    record(created_at=_at(DAY + timedelta(days=2)), status_code=500, error="boom", latency_ms=99999)
    record(tenant=other, created_at=_at(DAY), prompt_tokens=7, latency_ms=1)
    for offset in range(3):
        usage_rollup_day(day=DAY + timedelta(days=offset))


def test_usage_by_day_fills_quiet_days_with_zeros(usage, tenant):
    days = usage_by_day(tenant=tenant, start=DAY, end=DAY + timedelta(days=2))

    assert [(d["date"], d["requests"], d["errors"], d["prompt_tokens"], d["total_tokens"]) for d in days] == [
        (DAY, 2, 0, 15, 21),
        (DAY + timedelta(days=1), 0, 0, 0, 0),
        (DAY + timedelta(days=2), 2, 1, 100, 150),
    ]
    only_base = usage_by_day(tenant=tenant, start=DAY, end=DAY, model="base")
    assert only_base[0]["prompt_tokens"] == 5


def test_usage_by_model_most_tokens_first(usage, tenant):
    models = usage_by_model(tenant=tenant, start=DAY, end=DAY + timedelta(days=2))

    assert [(m["model"], m["requests"], m["errors"], m["total_tokens"]) for m in models] == [
        ("acme/bot", 3, 1, 161),
        ("base", 1, 0, 10),
    ]


def test_latency_percentiles_over_completed_requests_in_the_period(usage, tenant):
    result = latency_percentiles(tenant=tenant, start=DAY, end=DAY + timedelta(days=2))

    assert result["requests"] == 3
    assert result["latency_ms"]["p50"] == pytest.approx(200.0)
    assert result["latency_ms"]["p99"] == pytest.approx(percentile_cont([100, 200, 300], 0.99))
    assert result["ttft_ms"]["p95"] == pytest.approx(percentile_cont([10, 30], 0.95))
    one_model = latency_percentiles(tenant=tenant, start=DAY, end=DAY, model="base")
    assert one_model == {
        "requests": 1,
        "ttft_ms": {"p50": None, "p95": None, "p99": None},
        "latency_ms": {"p50": 200.0, "p95": 200.0, "p99": 200.0},
    }


def test_usage_record_list_is_the_tenants_oldest_first(usage, tenant):
    records = usage_record_list(tenant=tenant, start=DAY + timedelta(days=1))

    assert [r.prompt_tokens for r in usage_record_list(tenant=tenant)][:2] == [10, 5]
    assert {r.tenant for r in usage_record_list(tenant=tenant)} == {tenant}
    assert records.count() == 2


def test_end_before_start_is_refused(tenant):
    with pytest.raises(InvalidInput):
        usage_by_day(tenant=tenant, start=DAY, end=DAY - timedelta(days=1))

"""Per-version figures on the adapter page equal the ledger's; feedback is one per completion
per source, counted by the version that served it; bad input is refused, nothing stored."""

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.adapters.deployments import deployment_set_weights
from portal.core.exceptions import InvalidInput
from portal.core.ranges import parse_range
from portal.rollouts.models import Feedback
from portal.rollouts.selectors import version_comparison
from portal.rollouts.services import CompletionNotFound, feedback_record
from portal.tenants.services import tenant_create
from portal.usage.models import UsageRecord
from portal.usage.percentiles import percentile_cont
from portal.usage.rollups import usage_rollup_refresh

pytestmark = pytest.mark.django_db


def test_per_version_figures_from_the_rollups_equal_the_ledger(bot, record):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 75, 2: 25}, actor=None)
    now = timezone.now()
    for minutes in range(1, 50):
        at = now - timedelta(minutes=minutes)
        record(version=v1, created_at=at, time_to_first_token_ms=100.0 + minutes, inter_token_ms=10.0,
               prompt_tokens=20, completion_tokens=minutes)
        if minutes % 3 == 0:
            record(version=v2, created_at=at, time_to_first_token_ms=300.0 + minutes, inter_token_ms=12.0 + minutes,
                   prompt_tokens=20, completion_tokens=4)
        if minutes % 10 == 0:
            record(version=v2, created_at=at, status_code=400, error="adapter failed", error_code="adapter_load_failed")
    usage_rollup_refresh(now=now)  # the minute rows exist: the series read them
    time_range = parse_range({"range": "1h"}, now=now)
    result = version_comparison(adapter=bot, time_range=time_range)

    assert [v["label"] for v in result["versions"]] == ["v1", "v2"]
    total = UsageRecord.objects.filter(created_at__gte=time_range.start).count()
    for row, version in zip(result["versions"], (v1, v2), strict=True):
        ledger = UsageRecord.objects.filter(adapter_version=version, created_at__gte=time_range.start)
        ok = ledger.filter(status_code=200)
        assert row["requests"] == ledger.count()
        assert row["errors"] == ledger.exclude(status_code=200).count()
        assert row["share"] == pytest.approx(ledger.count() / total)
        assert row["ttft_p95_ms"] == pytest.approx(percentile_cont(ok.values_list("time_to_first_token_ms", flat=True), 0.95))
        assert row["itl_p50_ms"] == pytest.approx(percentile_cont(ok.values_list("inter_token_ms", flat=True), 0.5))
        tokens = sum(r.prompt_tokens + r.completion_tokens for r in ledger)
        assert row["tokens_per_request"] == pytest.approx(tokens / ledger.count())
        # per bucket (minute roll-ups): the same numbers as the ledger's rows of that minute
        series = next(s for s in result["series"] if s["label"] == f"v{version.number}")
        for start, requests, p95 in zip(result["starts"], series["requests"], series["ttft_p95_ms"], strict=True):
            begin = timezone.datetime.fromisoformat(start)
            minute = ledger.filter(created_at__gte=begin, created_at__lt=begin + timedelta(minutes=1))
            assert requests == minute.count()
            timings = minute.filter(status_code=200).values_list("time_to_first_token_ms", flat=True)
            assert p95 == (pytest.approx(percentile_cont(timings, 0.95)) if timings else None)
    assert result["versions"][0]["weight"] == 75 and result["versions"][1]["weight"] == 25


def test_feedback_is_one_per_completion_per_source_and_counted_by_version(bot, record, tenant):
    v1, v2 = bot.versions.order_by("number")
    served = record(version=v2, completion_id="chatcmpl-abc")
    first = feedback_record(tenant=tenant, completion_id="chatcmpl-abc", rating="up", source="api")
    again = feedback_record(tenant=tenant, completion_id="chatcmpl-abc", rating="down", comment="wrong city",
                            source="api")
    feedback_record(tenant=tenant, completion_id="chatcmpl-abc", rating="up", source="playground")
    assert again.pk == first.pk and Feedback.objects.count() == 2
    stored = Feedback.objects.get(source="api")
    assert (stored.rating, stored.comment, stored.usage_record_id, stored.adapter_version_id) == (
        "down", "wrong city", served.pk, v2.pk)
    result = version_comparison(adapter=bot, time_range=parse_range({"range": "1h"}, now=timezone.now()))
    row = next(v for v in result["versions"] if v["number"] == 2)
    assert (row["feedback_up"], row["feedback_down"]) == (1, 1)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"rating": "meh"}, "rating"), ({"rating": None}, "rating"), ({"completion_id": ""}, "id"),
    ({"completion_id": "x" * 201}, "id"), ({"source": "email"}, "source"), ({"comment": "y" * 2001}, "comment"),
    ({"comment": 5}, "comment"),
])
def test_bad_feedback_is_refused_and_nothing_is_stored(bot, record, tenant, kwargs, field):
    v1 = bot.versions.get(number=1)
    record(version=v1, completion_id="chatcmpl-ok")
    with pytest.raises(InvalidInput) as info:
        feedback_record(tenant=tenant, **{"completion_id": "chatcmpl-ok", "rating": "up", "source": "api", **kwargs})
    assert info.value.field == field
    assert not Feedback.objects.exists()


def test_feedback_on_an_unknown_or_another_tenants_completion_is_not_found(bot, record, tenant):
    record(version=bot.versions.get(number=1), completion_id="chatcmpl-acme")
    other = tenant_create(slug="globex", name="Globex")
    for who, completion_id in ((tenant, "chatcmpl-nope"), (other, "chatcmpl-acme")):
        with pytest.raises(CompletionNotFound):
            feedback_record(tenant=who, completion_id=completion_id, rating="up", source="api")
    assert not Feedback.objects.exists()

"""The worker's report on a request (RequestReport under REPORT_KEY) read back by the gateway:
what the worker writes comes back unchanged, and a reader tolerates anything else (an unknown
tier is "", a time that is not a finite non-negative number is None, a non-object is None)."""

from __future__ import annotations

import json

import pytest

from protocol.worker_api import ADAPTER_TIERS, REPORT_KEY, RequestReport


@pytest.mark.parametrize("tier", ["", *ADAPTER_TIERS])
def test_a_report_survives_the_wire(tier):
    report = RequestReport(adapter_tier=tier, queue_ms=0.0, ttft_ms=12.5, inter_token_ms=None)
    wire = json.loads(json.dumps({REPORT_KEY: report.to_json()}))
    assert RequestReport.from_json(wire[REPORT_KEY]) == report


@pytest.mark.parametrize("value", [None, [], "device", 3, True])
def test_what_is_not_an_object_is_no_report(value):
    assert RequestReport.from_json(value) is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("queue_ms", -1), ("queue_ms", "3"), ("queue_ms", True), ("ttft_ms", float("nan")),
     ("ttft_ms", float("inf")), ("inter_token_ms", [1]), ("inter_token_ms", None)],
)
def test_a_bad_time_is_none_and_the_rest_is_kept(field, value):
    report = RequestReport.from_json({"adapter_tier": "host", "queue_ms": 1, "ttft_ms": 2, "inter_token_ms": 3,
                                      field: value})
    assert getattr(report, field) is None and report.adapter_tier == "host"
    assert sum(getattr(report, name) is None for name in ("queue_ms", "ttft_ms", "inter_token_ms")) == 1


@pytest.mark.parametrize("tier", ["loading", "failed", "DEVICE", 1, None])
def test_an_unknown_tier_is_none(tier):
    assert RequestReport.from_json({"adapter_tier": tier, "queue_ms": 1.5}) == RequestReport(queue_ms=1.5)

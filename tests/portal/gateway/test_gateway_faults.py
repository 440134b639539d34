"""Faults: a client leaving mid-stream (one row flagged, the worker's request aborted), a worker
dying mid-stream (an error event, one row with the error), a dead worker ahead of a live one."""

from __future__ import annotations

import httpx
import openai
import pytest

from portal.fleet.selectors import routing_key
from tests.portal.gateway.conftest import (
    BASE,
    chat_prefix_key,
    dead_worker_url,
    sdk,
    start_worker,
    wait_for_row,
    wait_until,
)
from tests.portal.gateway.metrics_scrape import scrape

LONG = {"model": BASE, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 1000,
        "ignore_eos": True, "stream": True}


def test_client_disconnect_mid_stream_aborts_the_worker_request(acme, worker, live):
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=LONG,
                      headers={"authorization": f"Bearer {acme.key}"}, timeout=120) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert worker.metric("vllm:num_requests_running") >= 1
    row = wait_for_row(request_id)
    assert row.client_disconnected and row.status_code == 200 and row.error == ""
    assert 0 < row.completion_tokens < 1000
    wait_until(lambda: worker.metric("vllm:num_requests_running") == 0
               and worker.metric("vllm:num_requests_waiting") == 0, timeout=10)
    from portal.fleet.inflight import inflight_snapshot
    from portal.usage.models import UsageRecord

    assert UsageRecord.objects.filter(request_id=request_id).count() == 1
    # The gateway's own in-flight count (routing between polls) ends with the ledger: no leak.
    wait_until(lambda: inflight_snapshot().get(worker.url.rstrip("/"), 0) == 0, timeout=10)


@pytest.fixture
def throwaway_worker(tmp_path_factory):
    proc = start_worker(tmp_path_factory, "throwaway")
    yield proc
    proc.stop()


def test_worker_killed_mid_stream(acme, live, settings, throwaway_worker):
    from portal.gateway.resolve import base_model_forget

    settings.INFERENCE_URLS = [throwaway_worker.url]
    base_model_forget()
    failed = {"tenant": "acme", "model": BASE, "code": "worker_failed"}
    before = scrape(live.url)("loraplex_gateway_errors_total", **failed)
    stream = sdk(live, acme.key).chat.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                                         extra_body={"ignore_eos": True})
    request_id = stream.response.headers["x-request-id"]
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk)
            if len(received) == 3:
                throwaway_worker.proc.kill()
    assert "mid-stream" in str(info.value.message)
    row = wait_for_row(request_id)
    assert "mid-stream" in row.error and not row.client_disconnected
    assert row.worker_url == throwaway_worker.url
    assert row.status_code == 200 and row.error_code == "worker_failed" and row.upstream_attempts == 1
    # A 200 whose stream ended in an error event: counted as that error.
    assert scrape(live.url)("loraplex_gateway_errors_total", **failed) == before + 1


def test_a_dead_worker_first_in_line_is_skipped(acme, worker, live, settings):
    key = routing_key(None, chat_prefix_key(acme.tenant, [{"role": "user", "content": "Hi"}]))
    dead = dead_worker_url(key, worker.url, above=True)
    settings.INFERENCE_URLS = [dead, worker.url]
    raw = sdk(live, acme.key).chat.completions.with_raw_response.create(
        model=BASE, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert raw.status_code == 200
    row = wait_for_row(raw.headers["x-request-id"])
    assert row.worker_url == worker.url
    assert row.upstream_attempts == 2 and row.error_code == ""  # the dead one, then the live one

    settings.INFERENCE_URLS = [dead]
    with pytest.raises(openai.InternalServerError) as info:
        sdk(live, acme.key).chat.completions.create(model=BASE, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=2)
    assert info.value.status_code == 503 and info.value.body["code"] == "no_worker_available"
    row = wait_for_row(info.value.response.headers["x-request-id"])
    assert (row.status_code, row.error_code, row.upstream_attempts) == (503, "no_worker_available", 1)

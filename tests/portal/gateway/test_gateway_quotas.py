"""Quotas at the gateway: exactly the admitted number of concurrent requests pass, the rest are
429s in OpenAI's shape with the x-ratelimit-* headers; tokens settle with the actual usage; the
concurrency cap holds under parallel streams; the budget 429 tells the SDK not to retry."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.portal.gateway.conftest import BASE, make_caller, sdk, wait_for_row

BODY = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def test_fifty_concurrent_requests_against_ten_per_minute(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    quota_set(tenant=caller.tenant, requests_per_minute=10)

    async def fire():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*[
                client.post(f"{live.url}/v1/chat/completions", json=BODY,
                            headers={"authorization": f"Bearer {caller.key}"})
                for _ in range(50)])

    responses = asyncio.run(fire())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 10 + [429] * 40
    for response in responses:
        assert response.headers["x-ratelimit-limit-requests"] == "10"
        if response.status_code == 429:
            error = response.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "requests per minute" in error["message"]
            assert response.headers["x-ratelimit-remaining-requests"] == "0"
            assert response.headers["x-ratelimit-reset-requests"]
            assert int(response.headers["retry-after"]) >= 1
            assert "x-should-retry" not in response.headers
    for response in responses:  # refused before any worker: the code the client got, no attempt
        row = wait_for_row(response.headers["x-request-id"])
        expected = ("", 1) if response.status_code == 200 else ("rate_limit_exceeded", 0)
        assert (row.error_code, row.upstream_attempts) == expected
    ok = [r for r in responses if r.status_code == 200]
    for response in ok:
        row = wait_for_row(response.headers["x-request-id"])
        assert row.completion_tokens == response.json()["usage"]["completion_tokens"] == 1


def test_tokens_settle_with_the_actual_usage(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    # each request is estimated at ~200 tokens (max_tokens) but uses ~35: without settlement
    # the second would not fit under 300 per minute
    quota_set(tenant=caller.tenant, tokens_per_minute=300)
    client = sdk(live, caller.key)
    first = client.chat.completions.create(**{**BODY, "max_tokens": 200, "stop": [" ", "!", ".", ","],
                                              "temperature": 0})
    assert first.usage.total_tokens < 100, first.usage
    # (a non-streaming answer is sent after its settlement and ledger row)
    raw = client.chat.completions.with_raw_response.create(**{**BODY, "max_tokens": 200, "stop": [" ", "!", ".", ","]})
    assert raw.status_code == 200
    remaining = int(raw.headers["x-ratelimit-remaining-tokens"])
    assert remaining == 300 - first.usage.total_tokens - 200 - 2  # the second's estimate: prompt/4 + 200


def test_concurrency_cap_holds_under_parallel_streams(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    quota_set(tenant=caller.tenant, max_concurrent_requests=2)
    body = {**BODY, "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {caller.key}"}
    with httpx.Client(base_url=live.url, timeout=120) as http:
        streams = [http.stream("POST", "/v1/chat/completions", json=body, headers=headers) for _ in range(2)]
        opened = [s.__enter__() for s in streams]
        lines = [response.iter_lines() for response in opened]  # kept: dropping one closes its connection
        try:
            for response, line in zip(opened, lines, strict=True):
                assert response.status_code == 200
                assert next(line).startswith("data:")
            third = http.post("/v1/chat/completions", json=BODY, headers=headers)
            assert third.status_code == 429
            assert "concurrent" in third.json()["error"]["message"]
        finally:
            for stream in streams:
                stream.__exit__(None, None, None)
        for response in opened:
            wait_for_row(response.headers["x-request-id"])
        assert http.post("/v1/chat/completions", json=BODY, headers=headers).status_code == 200


def test_exhausted_budget_is_a_final_429(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    quota_set(tenant=caller.tenant, monthly_token_budget=60)
    client = sdk(live, caller.key)
    client.chat.completions.create(**{**BODY, "max_tokens": 5})  # ~36 tokens of the 60
    retrying = openai.OpenAI(base_url=f"{live.url}/v1", api_key=caller.key, max_retries=3, timeout=60)
    with pytest.raises(openai.RateLimitError) as info:
        retrying.chat.completions.create(**{**BODY, "max_tokens": 40})
    response = info.value.response
    assert response.headers["x-should-retry"] == "false"
    assert info.value.body["code"] == "insufficient_quota" and info.value.body["type"] == "insufficient_quota"
    assert "budget" in info.value.body["message"].lower()
    from portal.usage.models import UsageRecord

    [refused] = UsageRecord.objects.filter(tenant=caller.tenant, status_code=429)  # the SDK did not retry
    assert refused.error_code == "insufficient_quota" and refused.upstream_attempts == 0

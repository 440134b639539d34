"""Quota admission behaviour, identical on the Redis backend and the in-process one.

The tests are async bodies run through async_to_sync (see in_event_loop): the quota code's
async ORM calls (sync_to_async, thread-sensitive) then run on the test's own thread, inside its
rolled-back transaction, the way they run under an ASGI server; no slow table flushes.
"""

import asyncio
import functools
import re

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from portal.keys.services import api_key_create
from portal.quotas.backends import get_backend
from portal.quotas.services import (
    QuotaExceeded,
    quota_admit,
    quota_set,
    quota_settle,
    quota_usage,
)
from portal.tenants.services import tenant_create

pytestmark = pytest.mark.django_db


def in_event_loop(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        async def body():
            try:
                await test(*args, **kwargs)
            finally:
                backend = get_backend()
                if hasattr(backend, "aclose"):  # this loop's Redis connections
                    await backend.aclose()

        async_to_sync(body)()

    return run

aquota_set = sync_to_async(quota_set)
aquota_usage = sync_to_async(quota_usage)
aapi_key_create = sync_to_async(api_key_create)


def limited(tenant, **limits):
    """A tenant Quota row; limits not given stay null (the plan's apply)."""
    return quota_set(tenant=tenant, **limits)


async def admit(tenant, request_id, tokens=0, api_key=None):
    return await quota_admit(
        tenant=tenant, api_key=api_key, request_id=request_id, estimated_tokens=tokens
    )


async def outcomes(coroutines):
    results = await asyncio.gather(*coroutines, return_exceptions=True)
    unexpected = [r for r in results if isinstance(r, BaseException) and not isinstance(r, QuotaExceeded)]
    assert not unexpected, unexpected
    admitted = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    return admitted, refused


@in_event_loop
async def test_fifty_concurrent_admits_against_ten_per_minute_let_exactly_ten_in(
    backend, clock, tenant
):
    await sync_to_async(limited)(tenant, requests_per_minute=10, max_concurrent_requests=100)

    admitted, refused = await outcomes(admit(tenant, f"r{i}", 10) for i in range(50))

    assert (len(admitted), len(refused)) == (10, 40)
    remaining = sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in admitted)
    assert remaining == list(range(10))
    for error in refused:
        assert (error.limit, error.scope, error.should_retry) == ("requests_per_minute", "tenant", True)
        assert error.retry_after == 60
        assert error.headers["x-ratelimit-limit-requests"] == "10"
        assert error.headers["x-ratelimit-remaining-requests"] == "0"
        assert error.headers["x-ratelimit-reset-requests"] == "1m0s"
        assert error.headers["retry-after"] == "60"
        assert "x-should-retry" not in error.headers
        assert "requests per minute" in error.message and "tenant 'acme'" in error.message
        assert "limit 10, used 10" in error.message and "try again in 1m0s" in error.message
    usage = await aquota_usage(tenant=tenant)
    assert usage["requests_per_minute"]["used"] == 10
    assert usage["max_concurrent_requests"]["used"] == 10


@in_event_loop
async def test_the_window_reopens_after_a_minute_and_retry_after_counts_down(backend, clock, tenant):
    await sync_to_async(limited)(tenant, requests_per_minute=2)
    await admit(tenant, "a")
    clock.advance(20)
    await admit(tenant, "b")

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "c")
    assert refused.value.retry_after == 40
    assert refused.value.headers["x-ratelimit-reset-requests"] == "40s"

    clock.advance(40)
    admission = await admit(tenant, "d")
    assert admission.headers["x-ratelimit-remaining-requests"] == "1"
    assert admission.headers["x-ratelimit-reset-requests"] == "1m0s"


@in_event_loop
async def test_tokens_are_settled_to_the_actual_usage(backend, clock, tenant):
    await sync_to_async(limited)(tenant, tokens_per_minute=5000)

    first = await admit(tenant, "a", tokens=1000)
    assert first.headers["x-ratelimit-limit-tokens"] == "5000"
    assert first.headers["x-ratelimit-remaining-tokens"] == "4000"
    assert await quota_settle(admission=first, prompt_tokens=60, completion_tokens=40) is True

    usage = await aquota_usage(tenant=tenant)
    assert usage["tokens_per_minute"]["used"] == 100
    assert usage["monthly_token_budget"]["used"] == 100
    second = await admit(tenant, "b", tokens=1000)
    assert second.headers["x-ratelimit-remaining-tokens"] == str(5000 - 100 - 1000)


@in_event_loop
async def test_a_token_limit_refuses_until_settlement_gives_tokens_back(backend, clock, tenant):
    await sync_to_async(limited)(tenant, tokens_per_minute=1500)
    first = await admit(tenant, "a", tokens=1000)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", tokens=1000)
    assert refused.value.limit == "tokens_per_minute" and refused.value.should_retry
    assert "tokens per minute" in refused.value.message and "used 1000, requested 1000" in refused.value.message

    await quota_settle(admission=first, prompt_tokens=100, completion_tokens=0)
    await admit(tenant, "b", tokens=1000)


@in_event_loop
async def test_usage_above_the_estimate_is_charged_too(backend, clock, tenant):
    await sync_to_async(limited)(tenant, tokens_per_minute=5000)
    admission = await admit(tenant, "a", tokens=100)

    await quota_settle(admission=admission, prompt_tokens=900, completion_tokens=1100)

    usage = await aquota_usage(tenant=tenant)
    assert usage["tokens_per_minute"]["used"] == 2000
    assert usage["monthly_token_budget"]["used"] == 2000


@in_event_loop
async def test_a_request_larger_than_the_token_limit_is_told_not_to_retry(backend, clock, tenant):
    await sync_to_async(limited)(tenant, tokens_per_minute=1000)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "a", tokens=1001)

    assert (refused.value.limit, refused.value.should_retry) == ("tokens_per_minute", False)
    assert refused.value.headers["x-should-retry"] == "false"
    assert "Request too large" in refused.value.message


@in_event_loop
async def test_the_concurrency_cap_holds_under_parallel_admits_and_frees_on_settle(
    backend, clock, tenant
):
    await sync_to_async(limited)(tenant, max_concurrent_requests=3)

    admitted, refused = await outcomes(admit(tenant, f"r{i}") for i in range(20))

    assert (len(admitted), len(refused)) == (3, 17)
    assert {error.limit for error in refused} == {"max_concurrent_requests"}
    assert all(error.retry_after == 1 and error.should_retry for error in refused)
    assert "concurrent requests" in refused[0].message and "limit 3" in refused[0].message
    assert (await aquota_usage(tenant=tenant))["max_concurrent_requests"]["used"] == 3

    await quota_settle(admission=admitted[0], prompt_tokens=0, completion_tokens=0)
    again, still_refused = await outcomes(admit(tenant, f"s{i}") for i in range(5))
    assert (len(again), len(still_refused)) == (1, 4)


@in_event_loop
async def test_a_slot_held_by_a_crashed_request_expires(backend, clock, tenant, settings):
    settings.QUOTA_CONCURRENCY_LEASE_SECONDS = 120
    await sync_to_async(limited)(tenant, max_concurrent_requests=1)
    await admit(tenant, "crashed")  # never settled
    clock.advance(119)
    with pytest.raises(QuotaExceeded):
        await admit(tenant, "b")

    clock.advance(1)
    await admit(tenant, "c")


@in_event_loop
async def test_settling_twice_counts_once(backend, clock, tenant):
    await sync_to_async(limited)(tenant, max_concurrent_requests=2, tokens_per_minute=10_000)
    first = await admit(tenant, "a", tokens=1000)
    await admit(tenant, "b", tokens=1000)

    assert await quota_settle(admission=first, prompt_tokens=50, completion_tokens=50) is True
    assert await quota_settle(admission=first, prompt_tokens=50, completion_tokens=50) is False
    assert await quota_settle(admission=first, prompt_tokens=0, completion_tokens=0) is False

    usage = await aquota_usage(tenant=tenant)
    assert usage["tokens_per_minute"]["used"] == 100 + 1000
    assert usage["monthly_token_budget"]["used"] == 100 + 1000
    assert usage["max_concurrent_requests"]["used"] == 1
    await admit(tenant, "c")
    with pytest.raises(QuotaExceeded):  # "b" still holds its slot
        await admit(tenant, "d")


@in_event_loop
async def test_concurrent_double_settles_count_once(backend, clock, tenant):
    admission = await admit(tenant, "a", tokens=1000)

    settled = await asyncio.gather(
        *(quota_settle(admission=admission, prompt_tokens=10, completion_tokens=0) for _ in range(10))
    )

    assert sorted(settled) == [False] * 9 + [True]
    assert (await aquota_usage(tenant=tenant))["tokens_per_minute"]["used"] == 10


@in_event_loop
async def test_an_exhausted_monthly_budget_says_do_not_retry(backend, clock, tenant):
    await sync_to_async(limited)(tenant, monthly_token_budget=1000)
    admission = await admit(tenant, "a", tokens=700)
    await quota_settle(admission=admission, prompt_tokens=300, completion_tokens=400)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", tokens=301)

    error = refused.value
    assert (error.limit, error.scope, error.should_retry) == ("monthly_token_budget", "tenant", False)
    assert error.headers["x-should-retry"] == "false"
    seconds_to_june = 16 * 86400 + 12 * 3600  # the clock stands at 2031-05-15 12:00 UTC
    assert error.retry_after == seconds_to_june
    assert error.headers["retry-after"] == str(seconds_to_june)
    assert "Monthly token budget" in error.message and "resets at 2031-06-01T00:00:00Z" in error.message
    await admit(tenant, "c", tokens=300)  # what is left still fits


@in_event_loop
async def test_the_budget_starts_over_in_a_new_month(backend, clock, tenant):
    await sync_to_async(limited)(tenant, monthly_token_budget=1000)
    await admit(tenant, "a", tokens=1000)
    with pytest.raises(QuotaExceeded):
        await admit(tenant, "b", tokens=1)

    clock.advance(17 * 86400)

    await admit(tenant, "c", tokens=1000)
    assert (await aquota_usage(tenant=tenant))["monthly_token_budget"]["month"] == "2031-06"


@in_event_loop
async def test_key_limits_stricter_than_the_tenants_apply_to_that_key_only(backend, clock, tenant):
    await sync_to_async(limited)(tenant, requests_per_minute=100)
    strict, _ = await aapi_key_create(tenant=tenant, name="strict")
    loose, _ = await aapi_key_create(tenant=tenant, name="loose")
    await aquota_set(api_key=strict, requests_per_minute=2)

    first = await admit(tenant, "a", api_key=strict)
    await admit(tenant, "b", api_key=strict)
    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "c", api_key=strict)
    await admit(tenant, "d", api_key=loose)

    assert first.headers["x-ratelimit-limit-requests"] == "2"  # the tighter scope's numbers
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert (refused.value.limit, refused.value.scope) == ("requests_per_minute", "key")
    assert "API key 'strict'" in refused.value.message
    assert (await aquota_usage(tenant=tenant))["requests_per_minute"]["used"] == 3
    key_usage = await aquota_usage(tenant=tenant, api_key=strict)
    assert (key_usage["scope"], key_usage["requests_per_minute"]) == (
        "key",
        {"used": 2, "limit": 2, "resets_in_seconds": 60.0},
    )


@in_event_loop
async def test_the_tenants_limit_binds_a_key_with_a_looser_one(backend, clock, tenant):
    await sync_to_async(limited)(tenant, requests_per_minute=1)
    key, _ = await aapi_key_create(tenant=tenant, name="k")
    await aquota_set(api_key=key, requests_per_minute=50)
    await admit(tenant, "a", api_key=key)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", api_key=key)

    assert refused.value.scope == "tenant"


@in_event_loop
async def test_plan_defaults_apply_without_a_quota_row(backend, clock, tenant):
    admission = await admit(tenant, "a", tokens=100)  # "acme" is on the free plan

    assert admission.headers == {
        "x-ratelimit-limit-requests": "60",
        "x-ratelimit-remaining-requests": "59",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "40000",
        "x-ratelimit-remaining-tokens": "39900",
        "x-ratelimit-reset-tokens": "1m0s",
    }
    _, refused = await outcomes(admit(tenant, f"r{i}") for i in range(4))
    assert [error.limit for error in refused] == ["max_concurrent_requests"]  # 4 in flight at most


@in_event_loop
async def test_null_fields_of_a_tenant_quota_fall_back_to_the_plan(backend, clock, tenant):
    await sync_to_async(limited)(tenant, tokens_per_minute=500)

    admission = await admit(tenant, "a", tokens=100)

    assert admission.headers["x-ratelimit-limit-requests"] == "60"
    assert admission.headers["x-ratelimit-limit-tokens"] == "500"


@in_event_loop
async def test_an_unlimited_plan_sends_no_rate_headers(backend, clock, db):
    big = await sync_to_async(tenant_create)(slug="bigco", name="Big", plan="enterprise")

    admission = await admit(big, "a", tokens=10**9)

    assert admission.headers == {}
    assert (await aquota_usage(tenant=big))["max_concurrent_requests"] == {"used": 1, "limit": 256}


@in_event_loop
async def test_a_refused_admit_takes_nothing(backend, clock, tenant):
    await sync_to_async(limited)(
        tenant, requests_per_minute=10, tokens_per_minute=1000, monthly_token_budget=10_000
    )
    await admit(tenant, "a", tokens=600)
    before = await aquota_usage(tenant=tenant)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", tokens=600)  # rpm, concurrency and budget fit; tokens don't

    assert refused.value.limit == "tokens_per_minute"
    assert await aquota_usage(tenant=tenant) == before
    assert before["requests_per_minute"]["used"] == 1
    assert before["max_concurrent_requests"]["used"] == 1
    assert before["monthly_token_budget"]["used"] == 600


@in_event_loop
async def test_a_key_refusal_takes_nothing_from_the_tenant(backend, clock, tenant):
    key, _ = await aapi_key_create(tenant=tenant, name="k")
    await aquota_set(api_key=key, tokens_per_minute=500)
    await admit(tenant, "a", tokens=400, api_key=key)
    before = await aquota_usage(tenant=tenant)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", tokens=400, api_key=key)

    assert (refused.value.limit, refused.value.scope) == ("tokens_per_minute", "key")
    assert await aquota_usage(tenant=tenant) == before
    assert before["requests_per_minute"]["used"] == 1


@in_event_loop
async def test_the_longest_wait_is_reported_when_several_limits_fail(backend, clock, tenant):
    await sync_to_async(limited)(
        tenant, requests_per_minute=1, max_concurrent_requests=1, monthly_token_budget=100
    )
    await admit(tenant, "a", tokens=100)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", tokens=1)

    assert refused.value.limit == "monthly_token_budget"  # retrying in a minute won't help


@in_event_loop
async def test_a_settlement_after_the_window_rolled_corrects_only_the_month(backend, clock, tenant):
    admission = await admit(tenant, "a", tokens=1000)
    clock.advance(61)
    await admit(tenant, "b", tokens=50)

    await quota_settle(admission=admission, prompt_tokens=100, completion_tokens=0)

    usage = await aquota_usage(tenant=tenant)
    assert usage["tokens_per_minute"]["used"] == 50  # the new window never held "a"'s estimate
    assert usage["monthly_token_budget"]["used"] == 100 + 50
    assert usage["max_concurrent_requests"]["used"] == 1


@in_event_loop
async def test_bad_arguments_are_refused_before_anything_is_taken(backend, clock, tenant):
    from portal.core.exceptions import InvalidInput

    with pytest.raises(InvalidInput, match="estimated_tokens"):
        await admit(tenant, "a", tokens=-1)
    with pytest.raises(InvalidInput, match="request_id"):
        await admit(tenant, "", tokens=1)
    admission = await admit(tenant, "a", tokens=1)
    with pytest.raises(InvalidInput, match="completion_tokens"):
        await quota_settle(admission=admission, prompt_tokens=1, completion_tokens=True)
    assert re.fullmatch(r"\d+", admission.headers["x-ratelimit-remaining-requests"])

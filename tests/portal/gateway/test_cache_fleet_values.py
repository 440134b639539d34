"""The fleet's values on the gateway's request path (portal.gateway.cache.FleetValues): read once
per FLEET_TTL, then served stale (up to FLEET_STALE_TTL) while one background read replaces them,
so a steady stream of requests never waits on the database for them."""

from __future__ import annotations

import asyncio
import contextvars
import logging

import pytest

from portal.gateway import cache

FRESH = 0.05  # seconds (the module's FLEET_TTL, shortened so the tests run in a blink)
STALE = 0.4


@pytest.fixture(autouse=True)
def short_ttls(monkeypatch):
    monkeypatch.setattr(cache, "FLEET_TTL", FRESH)
    monkeypatch.setattr(cache, "FLEET_STALE_TTL", STALE)


class Source:
    """A fleet table: each read answers the value as it was when the read began, `delay` seconds
    later."""

    def __init__(self, value, delay: float = 0.0):
        self.value = value
        self.delay = delay
        self.reads = 0
        self.fail = False

    async def load(self):
        self.reads += 1
        value, fail = self.value, self.fail
        await asyncio.sleep(self.delay)
        if fail:
            raise OSError("database unreachable")
        return value


async def settle():
    for _ in range(5):  # the background read's task, its sleep(0) and its done callback
        await asyncio.sleep(0.01)


async def test_a_fresh_value_is_read_once():
    values, source = cache.FleetValues(), Source("rows-1")
    assert [await values.get("rows", source.load) for _ in range(5)] == ["rows-1"] * 5
    assert source.reads == 1


async def test_past_the_ttl_the_stale_value_is_served_at_once_and_replaced_behind():
    values, source = cache.FleetValues(), Source("rows-1", delay=0.05)
    assert await values.get("rows", source.load) == "rows-1"
    source.value = "rows-2"
    await asyncio.sleep(FRESH * 1.5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    # Many requests past the TTL: each gets the old rows without waiting; one read runs.
    assert [await values.get("rows", source.load) for _ in range(10)] == ["rows-1"] * 10
    assert loop.time() - started < 0.04  # not one waited out the read's 50 ms
    await asyncio.sleep(0.1)
    assert await values.get("rows", source.load) == "rows-2"
    assert source.reads == 2


async def test_a_value_past_the_stale_ttl_is_read_before_answering():
    values, source = cache.FleetValues(), Source("rows-1")
    await values.get("rows", source.load)
    source.value = "rows-2"
    await asyncio.sleep(STALE * 1.2)
    assert await values.get("rows", source.load) == "rows-2"
    assert source.reads == 2


async def test_a_clear_during_a_read_keeps_that_reads_answer_out():
    values, source = cache.FleetValues(), Source("before the change", delay=0.05)
    reading = asyncio.ensure_future(values.get("rows", source.load))
    await asyncio.sleep(0.01)
    values.clear()  # the worker rows changed while the read was under way
    source.value, source.delay = "after the change", 0.0
    assert await reading == "before the change"  # that request had asked before the change
    assert await values.get("rows", source.load) == "after the change"
    assert source.reads == 2


async def test_a_failed_background_read_keeps_the_stale_value_and_is_retried(caplog):
    values, source = cache.FleetValues(), Source("rows-1")
    await values.get("rows", source.load)
    source.fail = True
    await asyncio.sleep(FRESH * 1.5)
    with caplog.at_level(logging.WARNING, logger="portal.gateway.cache"):
        assert await values.get("rows", source.load) == "rows-1"
        await settle()
    assert "reading the fleet's rows failed" in caplog.text
    source.fail, source.value = False, "rows-2"
    assert await values.get("rows", source.load) == "rows-1"  # still within STALE: served, read again
    await settle()
    assert await values.get("rows", source.load) == "rows-2"
    assert source.reads == 3


async def test_a_failed_read_with_nothing_to_serve_fails_the_request():
    values, source = cache.FleetValues(), Source("rows")
    source.fail = True
    with pytest.raises(OSError):
        await values.get("rows", source.load)
    source.fail = False
    assert await values.get("rows", source.load) == "rows"


async def test_the_background_read_runs_outside_the_requests_context():
    # The request's context holds asgiref's ThreadSensitiveContext, gone once the request ends;
    # a read behind it must not run its query there.
    request_only = contextvars.ContextVar("request_only", default=None)
    seen = []
    values, source = cache.FleetValues(), Source("rows")

    async def load():
        seen.append(request_only.get())
        return await source.load()

    await values.get("rows", load)
    await asyncio.sleep(FRESH * 1.5)
    request_only.set("a request's")
    await values.get("rows", load)  # stale: served, read behind
    await settle()
    await asyncio.sleep(STALE * 1.2)
    await values.get("rows", load)  # too old: read in the request, as it waits for it
    assert seen == [None, None, "a request's"]


async def test_names_are_read_apart():
    values = cache.FleetValues()
    base, rows = Source("smollm2"), Source(["worker-a"])
    assert await values.get("base_model_name", base.load) == "smollm2"
    assert await values.get("route_rows", rows.load) == ["worker-a"]
    assert (base.reads, rows.reads) == (1, 1)

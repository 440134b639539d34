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
    later, or (gated) once `gate` is set."""

    def __init__(self, value, delay: float = 0.0):
        self.value = value
        self.delay = delay
        self.reads = 0
        self.fail = False
        self.gate: asyncio.Event | None = None

    async def load(self):
        self.reads += 1
        value, fail, gate = self.value, self.fail, self.gate
        await asyncio.sleep(self.delay)
        if gate is not None:
            await gate.wait()
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
    values, source = cache.FleetValues(), Source("rows-1")
    assert await values.get("rows", source.load) == "rows-1"
    source.value, source.gate = "rows-2", asyncio.Event()  # the next read hangs until the gate opens
    await asyncio.sleep(FRESH * 1.5)
    # Many requests past the TTL: each gets the old rows while the one read behind them hangs.
    assert [await values.get("rows", source.load) for _ in range(10)] == ["rows-1"] * 10
    await settle()
    assert source.reads == 2  # one read behind the ten, still hanging
    source.gate.set()
    await settle()
    assert await values.get("rows", source.load) == "rows-2"


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
    # The request's context holds its asgiref ThreadSensitiveContext, whose executor is shut down
    # when the request ends: a read behind it must not run its query there.
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


@pytest.mark.django_db(transaction=True)
async def test_the_worker_rows_are_reread_from_postgresql_behind_a_request_that_has_ended():
    # The gateway's own loader (portal.gateway.relay) on PostgreSQL. A request's
    # ThreadSensitiveContext (Django's handler opens one per request) starts the read behind it
    # and ends before the query runs; the read still lands, and the polls' queryset.update (no
    # signals) is seen.
    from asgiref.sync import ThreadSensitiveContext, sync_to_async

    from portal.core.db import db_sync_to_async
    from portal.fleet.models import InferenceWorker
    from portal.fleet.selectors import route_rows

    worker = await sync_to_async(InferenceWorker.objects.create)(url="http://127.0.0.2:8001", healthy=True)
    request_ended = asyncio.Event()
    request_ended.set()

    async def load():  # route_rows, its query held until the request that started it has ended
        await request_ended.wait()
        return await db_sync_to_async(route_rows)()

    values = cache.FleetValues()
    async with ThreadSensitiveContext():
        rows, _ = await values.get("route_rows", load)
    assert [w.url for w in rows] == [worker.url]

    await sync_to_async(InferenceWorker.objects.filter(pk=worker.pk).update)(healthy=False)  # a poll
    await asyncio.sleep(FRESH * 1.5)
    request_ended.clear()
    async with ThreadSensitiveContext():
        rows, _ = await values.get("route_rows", load)  # stale: served, read behind
    request_ended.set()
    assert [w.url for w in rows] == [worker.url]
    for _ in range(100):  # the read behind, on its own thread, after the request's context ended
        await asyncio.sleep(0.02)
        rows, _ = await values.get("route_rows", load)
        if not rows:
            break
    assert rows == []

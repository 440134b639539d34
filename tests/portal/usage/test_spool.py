"""The usage spool against real PostgreSQL and Redis: a row the database would not take is kept
(Redis, else a local file) and written back exactly once when it returns; a row that can never
be written is set aside, not retried forever, and does not hold up the others."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import UTC, datetime

import pytest
import redis
from django.db import connection, connections

from portal.keys.services import api_key_create
from portal.tenants.services import tenant_create
from portal.usage import spool
from portal.usage.models import UsageRecord

REDIS_URL = os.environ.get("REDIS_URL")
STARTED = datetime(2026, 11, 30, 9, 15, tzinfo=UTC)


@pytest.fixture
def spool_settings(settings, tmp_path):
    """A spool key and spool directory of this test's own (removed afterwards)."""
    settings.USAGE_SPOOL_KEY = f"test:spool:{uuid.uuid4().hex}"
    settings.STORAGE_ROOT = tmp_path / "storage"
    settings.REDIS_URL = REDIS_URL
    yield settings
    if REDIS_URL:
        client = redis.Redis.from_url(REDIS_URL)
        client.delete(*(settings.USAGE_SPOOL_KEY + suffix for suffix in ("", ":dead", ":lock", ":replays")))
        client.close()


def fields(tenant, **overrides) -> dict:
    values = dict(request_id=f"req_{uuid.uuid4().hex}", tenant=tenant, api_key=None, model="acme/bot\x00",
                  adapter_version=None, worker_url="http://w:8001", stream=True, prompt_tokens=12,
                  completion_tokens=30, time_to_first_token_ms=41.5, latency_ms=900.0, finish_reason="stop",
                  error="", status_code=200, client_disconnected=False, created_at=STARTED,
                  finished_at=STARTED)
    values.update(overrides)
    return values


def spooled_in_redis(settings) -> list[str]:
    client = redis.Redis.from_url(REDIS_URL)
    try:
        return [raw.decode() for raw in client.lrange(settings.USAGE_SPOOL_KEY, 0, -1)]
    finally:
        client.close()


def break_database(monkeypatch) -> None:
    """Point new connections at a port nothing listens on: what the web process sees while
    PostgreSQL is down (the settings dict is shared by every thread's connections)."""
    connection.close()
    monkeypatch.setitem(connections.settings["default"], "PORT", "1")


def test_a_row_round_trips_through_json(tenant):
    api_key, _ = api_key_create(tenant=tenant, name="k")
    original = fields(tenant, api_key=api_key, error="surrogate \ud800 here", constrained="json_schema")

    restored = spool.record_from_json(spool.record_to_json(original))

    assert restored == original


@pytest.mark.skipif(not REDIS_URL, reason="needs REDIS_URL")
@pytest.mark.django_db(transaction=True)
def test_a_row_the_database_refuses_is_retried_then_spooled_to_redis(spool_settings, monkeypatch):
    tenant = tenant_create(slug="acme", name="Acme")
    row = fields(tenant)
    monkeypatch.setattr(spool, "RETRY_DELAYS", (0.0, 0.0))
    break_database(monkeypatch)

    where = asyncio.run(spool.usage_record_save(row))

    assert where == "redis"
    assert json.loads(spooled_in_redis(spool_settings)[0])["request_id"] == row["request_id"]
    monkeypatch.undo()
    connection.close()
    assert spool.usage_spool_replay() == {"written": 1, "dead": 0, "left": 0}
    assert UsageRecord.objects.filter(request_id=row["request_id"]).count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_row_the_database_takes_is_not_spooled(spool_settings):
    tenant = tenant_create(slug="acme", name="Acme")
    row = fields(tenant)

    assert asyncio.run(spool.usage_record_save(row)) == "written"
    assert UsageRecord.objects.filter(request_id=row["request_id"]).count() == 1
    assert not spool.spool_dir().exists()


@pytest.mark.skipif(not REDIS_URL, reason="needs REDIS_URL")
def test_replay_writes_spooled_rows_exactly_once(spool_settings, tenant):
    rows = [fields(tenant, constrained="tools") for _ in range(3)]
    for row in rows:
        assert spool.usage_spool_push(row) == "redis"
    spool.usage_spool_push(rows[0])  # spooled twice (a retry that had in fact landed)

    assert spool.usage_spool_replay() == {"written": 4, "dead": 0, "left": 0}
    assert spool.usage_spool_replay() == {"written": 0, "dead": 0, "left": 0}

    stored = UsageRecord.objects.filter(request_id__in=[row["request_id"] for row in rows])
    assert stored.count() == 3
    first = stored.get(request_id=rows[0]["request_id"])
    assert (first.prompt_tokens, first.completion_tokens, first.model) == (12, 30, "acme/bot\ufffd")
    assert first.created_at == STARTED and first.stream and first.constrained == "tools"
    assert spooled_in_redis(spool_settings) == []


@pytest.mark.skipif(not REDIS_URL, reason="needs REDIS_URL")
def test_a_row_that_can_never_be_written_is_set_aside(spool_settings, tenant):
    gone = tenant_create(slug="gone", name="Gone")
    orphan = fields(gone)
    kept = fields(tenant)
    spool.usage_spool_push(orphan)
    spool.usage_spool_push(kept)
    gone.delete()

    assert spool.usage_spool_replay() == {"written": 1, "dead": 1, "left": 0}

    assert UsageRecord.objects.filter(request_id=kept["request_id"]).exists()
    client = redis.Redis.from_url(REDIS_URL)
    dead = client.lrange(spool_settings.USAGE_SPOOL_KEY + ":dead", 0, -1)
    client.close()
    assert [json.loads(line)["request_id"] for line in dead] == [orphan["request_id"]]


@pytest.mark.skipif(not REDIS_URL, reason="needs REDIS_URL")
def test_replays_add_up_in_redis_for_the_web_processes_metrics(spool_settings, tenant):
    from portal.core.metrics import LEDGER_WRITES

    assert spool.usage_spool_replay_totals() == {"replayed": 0, "dead": 0}
    gone = tenant_create(slug="gone", name="Gone")
    for row in (fields(gone), fields(tenant), fields(tenant)):
        spool.usage_spool_push(row)
    gone.delete()

    spool.usage_spool_replay()
    spool.usage_spool_replay()  # nothing left: adds nothing
    spool.usage_spool_push(fields(tenant))
    spool.usage_spool_replay()

    assert spool.usage_spool_replay_totals() == {"replayed": 3, "dead": 1}
    [family] = LEDGER_WRITES.collect()
    shared = {s.labels["outcome"]: s.value for s in family.samples if s.labels["outcome"] in ("replayed", "dead")}
    assert shared == {"replayed": 3, "dead": 1}  # what the web's /metrics reads (portal.usage's AppConfig)
    spool_settings.REDIS_URL = None
    assert spool.usage_spool_replay_totals() is None


@pytest.mark.django_db(transaction=True)
def test_each_save_counts_as_written_or_spooled(spool_settings, monkeypatch):
    from portal.core.metrics import LEDGER_WRITES

    def counts() -> dict[str, float]:
        [family] = LEDGER_WRITES.collect()
        return {s.labels["outcome"]: s.value for s in family.samples if s.labels["outcome"] in ("written", "spooled")}

    tenant = tenant_create(slug="acme", name="Acme")
    before = counts()
    asyncio.run(spool.usage_record_save(fields(tenant)))
    monkeypatch.setattr(spool, "RETRY_DELAYS", ())
    break_database(monkeypatch)
    asyncio.run(spool.usage_record_save(fields(tenant)))

    assert counts() == {"written": before["written"] + 1, "spooled": before["spooled"] + 1}


def test_without_redis_a_row_goes_to_a_file_and_back(spool_settings, tenant):
    spool_settings.REDIS_URL = "redis://127.0.0.1:1/0"  # configured, but down
    row = fields(tenant)

    where = spool.usage_spool_push(row)

    path = spool.spool_dir() / os.path.basename(where)
    assert path.exists() and json.loads(path.read_text())["request_id"] == row["request_id"]
    assert oct(path.stat().st_mode & 0o777) == "0o600"  # rows carry tenants' usage: not world-readable

    spool_settings.REDIS_URL = None
    assert spool.usage_spool_replay() == {"written": 1, "dead": 0, "left": 0}
    assert UsageRecord.objects.filter(request_id=row["request_id"]).count() == 1
    assert not list(spool.spool_dir().glob("*.jsonl")) and not list(spool.spool_dir().glob("*.replaying"))


@pytest.mark.django_db(transaction=True)
def test_a_replay_while_the_database_is_still_down_keeps_every_row(spool_settings, monkeypatch):
    spool_settings.REDIS_URL = None
    tenant = tenant_create(slug="acme", name="Acme")
    rows = [fields(tenant) for _ in range(2)]
    for row in rows:
        spool.usage_spool_push(row)

    break_database(monkeypatch)
    assert spool.usage_spool_replay() == {"written": 0, "dead": 0, "left": 2}
    monkeypatch.undo()
    connection.close()

    assert spool.usage_spool_replay() == {"written": 2, "dead": 0, "left": 0}
    assert UsageRecord.objects.filter(request_id__in=[r["request_id"] for r in rows]).count() == 2

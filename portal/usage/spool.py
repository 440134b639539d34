"""Ledger rows the database could not take, kept until it can: nothing a tenant used is dropped.

    await usage_record_save(fields)   the gateway, when a request ends: usage_record_create,
                                      retried (RETRY_DELAYS); if the database still refuses
                                      (down, or the pool exhausted), the row is spooled
    usage_spool_replay()              Celery beat every SPOOL_REPLAY_SECONDS (`manage.py
                                      run_schedule` without Redis): writes spooled rows back

Where a spooled row waits, most durable first:
    Redis      the list settings.USAGE_SPOOL_KEY (<REDIS_KEY_PREFIX>usage:spool), when REDIS_URL is
               set: one list for every web process
    a file     <STORAGE_ROOT>/usage-spool/<host>-<pid>.jsonl, appended and fsynced, when Redis is
               not configured or refuses too (STORAGE_ROOT is the web side's persistent volume)

Rows are JSON: model instances become ids, datetimes ISO 8601. usage_record_create is idempotent
on request_id, so a row written twice (a replay that crashed half-way, a write that timed out
after the database took it) is still one row. A row that cannot be written for a reason other
than the database being unreachable (its tenant deleted meanwhile...) moves to the list `<spool key>:dead` /
a `.dead` file and is logged at ERROR: kept for an operator, never retried forever.

Metrics (portal.core.metrics, loraplex_ledger_writes_total{outcome}): each save counts as written
or spooled in the web process; each replay adds what it wrote back and set aside to the Redis
hash `<spool key>:replays` (fields replayed, dead), which /metrics reads: the replay runs in a
Celery worker, which serves no /metrics.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import socket
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, InterfaceError, OperationalError, connection

from portal.adapters.models import AdapterVersion
from portal.core.metrics import LEDGER_WRITES
from portal.keys.models import ApiKey
from portal.tenants.models import Tenant
from portal.usage.services import usage_record_create

log = logging.getLogger(__name__)

SPOOL_DIR_NAME = "usage-spool"
SPOOL_REPLAY_SECONDS = 30
# Seconds before each retry of a failed write: a restarting database or a pool that frees a
# connection gets about 4 s before the row is spooled.
RETRY_DELAYS = (0.2, 1.0, 3.0)
# The database is unreachable or refused the connection: worth retrying later.
TRANSIENT_ERRORS = (OperationalError, InterfaceError)
REDIS_TIMEOUT = 2.0
REPLAY_BATCH = 500

_MODEL_FIELDS = {"tenant": Tenant, "api_key": ApiKey, "adapter_version": AdapterVersion}
_TIME_FIELDS = ("created_at", "finished_at")


# -- writing ------------------------------------------------------------------------------------
def _create_and_release(fields: dict) -> None:
    # On an executor thread, not the request's: it may outlive the request after a disconnect.
    try:
        usage_record_create(**fields)
    finally:
        connection.close()  # back to the pool at once


async def usage_record_save(fields: dict) -> str:
    """Write one request's UsageRecord (usage_record_create's keyword arguments), retrying, and
    spool it if the database keeps refusing. Returns "written", or where it was spooled."""
    delays = iter(RETRY_DELAYS)
    while True:
        try:
            await sync_to_async(_create_and_release, thread_sensitive=False)(fields)
            LEDGER_WRITES.count("written")
            return "written"
        except Exception as exc:  # noqa: BLE001 -- whatever it was, the row must survive it
            delay = next(delays, None)
            if delay is None or not isinstance(exc, TRANSIENT_ERRORS):
                where = await sync_to_async(usage_spool_push, thread_sensitive=False)(fields)
                LEDGER_WRITES.count("spooled")
                log.error("usage row %s not written (%s: %s); spooled to %s", fields.get("request_id"),
                          type(exc).__name__, str(exc).strip()[:200], where)
                return where
            await asyncio.sleep(delay)


# -- the spool ------------------------------------------------------------------------------------
def record_to_json(fields: dict) -> str:
    data: dict[str, Any] = {}
    for name, value in fields.items():
        if name in _MODEL_FIELDS:
            data[f"{name}_id"] = value.pk if value is not None else None
        elif isinstance(value, datetime):
            data[name] = value.isoformat()
        else:
            data[name] = value
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))  # ASCII: any string survives


def record_from_json(text: str) -> dict:
    """usage_record_create's keyword arguments again (a deleted key or version becomes None; a
    deleted tenant raises Tenant.DoesNotExist: that row cannot be written)."""
    data = json.loads(text)
    fields = {}
    for name, value in data.items():
        model_name = name[:-3] if name.endswith("_id") else None
        if model_name in _MODEL_FIELDS:
            model = _MODEL_FIELDS[model_name]
            if value is None:
                fields[model_name] = None
            elif model is Tenant:
                fields[model_name] = Tenant.objects.get(pk=value)
            else:
                fields[model_name] = model.objects.filter(pk=value).first()
        elif name in _TIME_FIELDS and value is not None:
            fields[name] = datetime.fromisoformat(value)
        else:
            fields[name] = value
    return fields


def spool_key(suffix: str = "") -> str:
    return f"{settings.USAGE_SPOOL_KEY}{suffix}"


def _redis() -> redis.Redis | None:
    url = settings.REDIS_URL
    if not url:
        return None
    return redis.Redis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT, socket_timeout=REDIS_TIMEOUT)


def spool_dir() -> Path:
    return Path(settings.STORAGE_ROOT) / SPOOL_DIR_NAME


def usage_spool_push(fields: dict) -> str:
    """Keep one row for a later replay: Redis, else a local file. Returns where it went."""
    line = record_to_json(fields)
    client = _redis()
    if client is not None:
        try:
            client.rpush(spool_key(), line)
            return "redis"
        except redis.RedisError as exc:
            log.error("spooling usage row to Redis failed (%s); falling back to a file", exc)
        finally:
            client.close()
    host = "".join(c if c.isalnum() or c == "-" else "_" for c in socket.gethostname())
    return str(_append_line(spool_dir() / f"{host}-{os.getpid()}.jsonl", line))


def _append_line(path: Path, line: str) -> Path:
    """Append and fsync under an exclusive lock. A replay renames a file before reading it: a
    writer that opened the old name just before finds its inode unlinked and starts over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_nlink == 0:
                continue  # replayed and removed while we waited for the lock
            os.write(fd, (line + "\n").encode("ascii"))
            os.fsync(fd)
            return path
        finally:
            os.close(fd)


# -- replaying -----------------------------------------------------------------------------------
class _Stop(Exception):
    """The database is still unreachable: leave the rest for the next replay."""


def _replay_one(line: str) -> bool:
    """True when written (or already there); False when the row can never be written."""
    try:
        usage_record_create(**record_from_json(line))
        return True
    except TRANSIENT_ERRORS as exc:
        raise _Stop(str(exc)) from exc
    except (ValueError, LookupError, TypeError, DatabaseError, Tenant.DoesNotExist) as exc:
        log.error("spooled usage row cannot be written (%s: %s): %s", type(exc).__name__, exc, line[:500])
        return False


def usage_spool_replay(*, batch: int = REPLAY_BATCH) -> dict[str, int]:
    """Write spooled rows back to the ledger; returns counts {"written", "dead", "left"}.
    One replay at a time (a Redis lock; a file lock for files): rows are read from the head and
    removed only once handled, so a crash replays them again, harmlessly."""
    counts = {"written": 0, "dead": 0, "left": 0}
    try:
        _replay_redis(counts, batch)
        _replay_files(counts)
    except _Stop as stop:
        log.warning("usage spool replay paused: the database is unreachable (%s)", stop)
    finally:
        if not connection.in_atomic_block:
            connection.close()  # a broken connection must not stay for the next task
        _add_replay_totals(counts)
    return counts


def _add_replay_totals(counts: dict[str, int]) -> None:
    if not (counts["written"] or counts["dead"]):
        return
    client = _redis()
    if client is None:
        return  # no Redis: nothing to share the totals through (development)
    try:
        pipeline = client.pipeline(transaction=False)
        pipeline.hincrby(spool_key(":replays"), "replayed", counts["written"])
        pipeline.hincrby(spool_key(":replays"), "dead", counts["dead"])
        pipeline.execute()
    except redis.RedisError as exc:
        log.warning("usage spool replay: its totals were not recorded (%s)", exc)
    finally:
        client.close()


def usage_spool_replay_totals() -> dict[str, int] | None:
    """Rows every replay so far wrote back ("replayed") and set aside ("dead"), for /metrics;
    None without Redis. Raises redis.RedisError when Redis does not answer."""
    client = _redis()
    if client is None:
        return None
    try:
        totals = client.hgetall(spool_key(":replays"))
    finally:
        client.close()
    return {"replayed": int(totals.get(b"replayed", 0)), "dead": int(totals.get(b"dead", 0))}


def _replay_redis(counts: dict[str, int], batch: int) -> None:
    client = _redis()
    if client is None:
        return
    try:
        lock = client.lock(spool_key(":lock"), timeout=600, blocking=False)
        if not lock.acquire():
            return  # another replay is running
        try:
            while lines := client.lrange(spool_key(), 0, batch - 1):
                handled = 0
                try:
                    for raw in lines:
                        line = raw.decode("ascii")
                        if _replay_one(line):
                            counts["written"] += 1
                        else:
                            client.rpush(spool_key(":dead"), line)
                            counts["dead"] += 1
                        handled += 1
                finally:
                    client.ltrim(spool_key(), handled, -1)  # pushes only append: the head is ours
            counts["left"] += client.llen(spool_key())
        finally:
            lock.release()
    except redis.RedisError as exc:
        log.warning("usage spool replay: Redis unavailable (%s)", exc)
    finally:
        client.close()


def _replay_files(counts: dict[str, int]) -> None:
    directory = spool_dir()
    if not directory.is_dir():
        return
    with open(directory / ".replay.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        # Files a previous replay claimed but did not finish come first.
        claimed = sorted(directory.glob("*.replaying"))
        for path in sorted(directory.glob("*.jsonl")):
            target = path.with_name(f"{path.stem}.{uuid.uuid4().hex}.replaying")
            os.rename(path, target)
            claimed.append(target)
        for path in claimed:
            _replay_file(path, counts)


def _replay_file(path: Path, counts: dict[str, int]) -> None:
    with open(path, "r+", encoding="ascii") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # a writer that had it open has finished its line
        lines = [line for line in handle.read().splitlines() if line.strip()]
    for index, line in enumerate(lines):
        try:
            if _replay_one(line):
                counts["written"] += 1
            else:
                _append_line(path.with_suffix(".dead"), line)
                counts["dead"] += 1
        except _Stop:
            # Keep what is left, under a name the next replay picks up first.
            rest = path.with_name(f"rest-{uuid.uuid4().hex}.replaying")
            for remaining in lines[index:]:
                _append_line(rest, remaining)
            path.unlink()
            counts["left"] += len(lines) - index
            raise
    path.unlink()

"""Short-lived caches on the gateway's request path, so a request whose caller, model and limits
were seen moments ago reaches its worker without a database round trip.

    api keys       sha256 of the secret -> the ApiKey, its tenant loaded (portal.gateway.auth)
    adapter models (tenant id, model id) -> its ready versions and the deployment's weights
                   (portal.gateway.resolve; the traffic split is still picked per request)
    quota scopes   (tenant id, key id) -> portal.quotas.selectors.quota_scopes (portal.gateway.admit)
    fleet          the base model's name, the routable worker rows (portal.gateway.resolve, .relay)

Access (the first three: they decide who may do what) is tagged with the *generation* it was read
under. Any write to a key, tenant, quota, adapter, version or deployment (post_save / post_delete,
connected in GatewayConfig.ready; acted on at once and again when its transaction commits) clears
this process's entries and increments the generation in Redis; every web process reads it once per
request (one GET), so a revoked key, a suspended tenant, a retired version or a lowered quota is
refused by every process from the next request on. An entry read from the database before such a
commit is tagged with the old generation and never served after it. If Redis does not answer the
caches are not used at all (the database decides, as without them). Without Redis (one process,
development) the local counter is the whole generation. ACCESS_TTL bounds an entry's age anyway,
should an increment fail while the GETs succeed.

The fleet's rows are not access control, and the database's copy is itself a poll's snapshot (the
beat polls every worker every POLL_EVERY_SECONDS and writes with queryset.update: no signals). So
they are read again once FLEET_TTL old, and until FLEET_STALE_TTL old the value at hand is still
served while one read in the background replaces it: a request never waits on the database for
them while requests keep coming (that read was ~2 of the gateway's ~5.5 ms per request on a 2-core
EPYC, twice: the base name and the worker rows). A stale row sends a request to a worker that moved
on, which the relay already survives (it tries the next one).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import redis
import redis.asyncio
from django.conf import settings
from django.db import transaction

log = logging.getLogger(__name__)

ACCESS_TTL = 30.0  # seconds an access entry is served at most, whatever the generation says
FLEET_TTL = 1.0  # seconds the base name and the worker rows are served without being read again
FLEET_STALE_TTL = 10.0  # seconds they are served at most (one poll: portal.fleet.tasks.POLL_EVERY_SECONDS)
MAX_ENTRIES = 10_000  # per cache: past it the cache starts over (a flood of distinct keys)
REDIS_TIMEOUT = 0.5
MISSING = object()  # what get() answers for no usable entry

# The generation this request reads under, memoised for its duration (see request_scope).
_request_generation: ContextVar[list | None] = ContextVar("loraplex_gateway_cache_generation", default=None)


def generation_key() -> str:
    # Beside the quota counters: the gateway already talks to Redis there on every request, and
    # the prefix is per deployment (per test, too).
    return f"{settings.QUOTA_KEY_PREFIX}gateway-cache:generation"


class _State:
    def __init__(self) -> None:
        self.local = 0  # this process's invalidations
        self.lock = threading.Lock()
        self.clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> redis.asyncio
        self.sync_client: redis.Redis | None = None
        self.sync_url: str | None = None


_state = _State()


class Cache:
    """One map of entries (value, generation, expiry). Entries are whole objects handed to many
    requests: callers treat them as read-only."""

    def __init__(self, name: str, ttl: float) -> None:
        self.name = name
        self.ttl = ttl
        self._entries: dict[Any, tuple[Any, Any, float]] = {}
        _caches.append(self)

    def get(self, key: Any, generation: Any) -> Any:
        """The value, or MISSING (also when generation is None: caches off)."""
        if generation is None:
            return MISSING
        entry = self._entries.get(key)
        if entry is None:
            return MISSING
        value, tagged, expires = entry
        if tagged != generation or time.monotonic() >= expires:
            self._entries.pop(key, None)
            return MISSING
        return value

    def put(self, key: Any, value: Any, generation: Any) -> None:
        if generation is None:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()
        self._entries[key] = (value, generation, time.monotonic() + self.ttl)

    def clear(self) -> None:
        self._entries.clear()


_caches: list[Cache] = []

API_KEYS = Cache("api_keys", ACCESS_TTL)
ADAPTER_MODELS = Cache("adapter_models", ACCESS_TTL)
QUOTA_SCOPES = Cache("quota_scopes", ACCESS_TTL)


class FleetValues:
    """Values read from the fleet's rows, by name: fresh for FLEET_TTL seconds, then served as they
    are (up to FLEET_STALE_TTL) while one background read per name replaces them. A clear() while
    a read is under way keeps that read's answer out (it may predate the change)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[Any, float]] = {}  # name -> (value, when its read began)
        self._reading: dict[str, asyncio.Task] = {}  # name -> its background read
        self._epoch = 0  # clear() count

    def clear(self) -> None:
        self._epoch += 1
        self._entries.clear()

    async def get(self, name: str, load: Callable[[], Awaitable[Any]]) -> Any:
        entry = self._entries.get(name)
        if entry is not None:
            value, read_at = entry
            age = time.monotonic() - read_at
            if age < FLEET_TTL:
                return value
            if age < FLEET_STALE_TTL:
                self._read_behind(name, load)
                return value
        return await self._read(name, load)

    async def _read(self, name: str, load: Callable[[], Awaitable[Any]]) -> Any:
        epoch, read_at = self._epoch, time.monotonic()
        value = await load()
        if epoch == self._epoch:
            self._entries[name] = (value, read_at)
        return value

    def _read_behind(self, name: str, load: Callable[[], Awaitable[Any]]) -> None:
        loop = asyncio.get_running_loop()
        task = self._reading.get(name)
        if task is not None and not task.done() and task.get_loop() is loop:
            return  # one read per name at a time
        # In a context of its own, not the request's: there `load` would run its query on the
        # request's thread (asgiref's ThreadSensitiveContext), queued behind the request's own
        # steps, and once the request had ended on a new thread made for that one call.
        task = loop.create_task(self._read(name, load), name=f"gateway-cache-fleet-{name}",
                                context=contextvars.Context())
        self._reading[name] = task
        task.add_done_callback(lambda done: self._read_done(name, done))

    def _read_done(self, name: str, task: asyncio.Task) -> None:
        if self._reading.get(name) is task:
            del self._reading[name]
        if not task.cancelled() and task.exception() is not None:
            # The stale value stays until FLEET_STALE_TTL; the next request past FLEET_TTL retries.
            log.warning("gateway cache: reading the fleet's %s failed (%s)", name, task.exception())


FLEET = FleetValues()


# -- the generation -------------------------------------------------------------------------------
def _async_client() -> redis.asyncio.Redis:
    loop = asyncio.get_running_loop()
    client = _state.clients.get(loop)
    if client is None:
        client = redis.asyncio.Redis.from_url(settings.REDIS_URL, socket_timeout=REDIS_TIMEOUT,
                                              socket_connect_timeout=REDIS_TIMEOUT)
        _state.clients[loop] = client
    return client


async def _read_generation() -> tuple[int, bytes | None] | None:
    local = _state.local
    if not settings.REDIS_URL:
        return local, None
    try:
        shared = await _async_client().get(generation_key())
    except (redis.RedisError, OSError) as exc:  # no traceback: this repeats on every request meanwhile
        log.warning("gateway cache: Redis did not answer (%s); reading from the database", exc)
        return None
    return local, shared


async def generation() -> tuple | None:
    """The generation to read and write entries under; None: do not use the caches. Read once per
    /v1 request (request_scope), else on every call."""
    memo = _request_generation.get()
    if memo is not None and memo:
        return memo[0]
    value = await _read_generation()
    if memo is not None:
        memo.append(value)
    return value


@contextmanager
def request_scope() -> Iterator[None]:
    """One generation for the whole request run inside (portal.gateway.asgi opens it)."""
    token = _request_generation.set([])
    try:
        yield
    finally:
        _request_generation.reset(token)


def invalidate() -> None:
    """Forget every access entry, here and (through the Redis generation) in every web process.
    Called when a write that changes who may do what commits."""
    with _state.lock:
        _state.local += 1
    for cache in _caches:
        cache.clear()
    url = settings.REDIS_URL
    if not url:
        return
    try:
        with _state.lock:
            if _state.sync_client is None or _state.sync_url != url:
                _state.sync_client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT,
                                                          socket_connect_timeout=REDIS_TIMEOUT)
                _state.sync_url = url
            client = _state.sync_client
        client.incr(generation_key())
    except (redis.RedisError, OSError):
        # Other processes keep their entries up to ACCESS_TTL: the one bound left.
        log.error("gateway cache: the generation could not be incremented in Redis", exc_info=True)


def invalidate_on_commit(**_signal_kwargs) -> None:
    """A signal receiver: invalidate now (what this transaction reads next is fresh, a test's
    transaction that never commits included) and again once the write is committed, so no
    process that read the old row in between keeps it under the new generation."""
    invalidate()
    if transaction.get_connection().in_atomic_block:
        transaction.on_commit(invalidate)


def fleet_forget(**_signal_kwargs) -> None:
    """A signal receiver: the fleet's rows changed (reread them on the next request)."""
    FLEET.clear()


def forget_all() -> None:
    """Clear every cache of this process (tests, a fleet changed under them)."""
    invalidate()
    FLEET.clear()


async def fleet_cached(name: str, load: Callable[[], Awaitable[Any]]) -> Any:
    """The fleet value `name` (FleetValues: read by `load` at most once per FLEET_TTL, served up to
    FLEET_STALE_TTL old)."""
    return await FLEET.get(name, load)

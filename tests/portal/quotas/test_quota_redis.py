"""What only the Redis backend has: namespaced expiring keys, cached scripts, many clients."""

import asyncio
import os
import threading

import pytest
import redis

from portal.quotas import backends
from portal.quotas.limits import Clock, ScopeSpec, SettleTicket
from portal.quotas.memory_backend import MemoryQuotaBackend
from portal.quotas.redis_backend import ADMIT_LUA, SETTLE_LUA, RedisQuotaBackend

REDIS_URL = os.environ.get("REDIS_URL")
pytestmark = pytest.mark.skipif(REDIS_URL is None, reason="REDIS_URL is not set")


@pytest.fixture
def redis_backend(backend):
    if not isinstance(backend, RedisQuotaBackend):
        pytest.skip("Redis only")
    return backend


@pytest.fixture
def client():
    connection = redis.Redis.from_url(REDIS_URL)
    yield connection
    connection.close()


def scope(prefix: str, **limits) -> ScopeSpec:
    values = {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "max_concurrent_requests": None,
        "monthly_token_budget": None,
    }
    values.update(limits)
    return ScopeSpec(scope="tenant", label="tenant 't'", prefix=prefix, **values)


def settle_ticket(prefix: str, request_id: str, window_start: int, estimate: int, month: str):
    return SettleTicket(
        request_id=request_id,
        settled_key=f"{prefix}:settled:{request_id}",
        estimated_tokens=estimate,
        month=month,
        scopes=((prefix, window_start),),
    )


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_every_key_is_under_the_prefix_and_expires(redis_backend, client, settings):
    prefix = f"{settings.QUOTA_KEY_PREFIX}{{t1}}:tenant"
    clock = Clock.now()
    spec = scope(prefix, requests_per_minute=5)
    outcome = await redis_backend.admit(scopes=(spec,), request_id="r1", estimated_tokens=7, clock=clock)

    def ours():
        return sorted(key.decode() for key in client.scan_iter(match=f"{settings.QUOTA_KEY_PREFIX}*"))

    assert ours() == sorted(f"{prefix}:{suffix}" for suffix in ("window", "inflight", f"month:{clock.month}",
                                                                f"spend:{clock.month}"))
    assert all(key.startswith("loraplex:quota:") for key in ours())
    ttls = {key: client.pttl(key) for key in ours()}
    assert all(ttl > 0 for ttl in ttls.values()), ttls

    ticket = settle_ticket(prefix, "r1", outcome.states[0].window_start_ms, 7, clock.month)
    await redis_backend.settle(ticket=ticket, actual_tokens=3, clock=clock)
    await redis_backend.aclose()

    # the in-flight set emptied (Redis drops it); the settled marker expires too
    assert ours() == sorted(f"{prefix}:{suffix}" for suffix in ("window", f"month:{clock.month}",
                                                                f"spend:{clock.month}", "settled:r1"))
    assert 0 < client.pttl(f"{prefix}:settled:r1") <= 86_400_000
    assert ttls[f"{prefix}:window"] <= 61_000
    assert client.hgetall(f"{prefix}:window") == {
        b"start": str(clock.now_ms).encode(),
        b"req": b"1",
        b"tok": b"3",
    }


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
async def test_scripts_run_by_sha_and_survive_a_script_flush(redis_backend, client, settings):
    prefix = f"{settings.QUOTA_KEY_PREFIX}{{t2}}:tenant"
    spec = scope(prefix, requests_per_minute=5)
    await redis_backend.admit(scopes=(spec,), request_id="a", estimated_tokens=1, clock=Clock.now())
    loop_client = redis_backend._client()
    assert client.script_exists(loop_client.admit.sha, loop_client.settle.sha)[0] is True
    assert loop_client.admit.script == ADMIT_LUA and loop_client.settle.script == SETTLE_LUA

    client.script_flush()  # e.g. a Redis restart: EVALSHA fails, redis-py loads and retries
    outcome = await redis_backend.admit(scopes=(spec,), request_id="b", estimated_tokens=1, clock=Clock.now())
    await redis_backend.aclose()

    assert outcome.refusal is None and outcome.states[0].requests == 2


@pytest.mark.parametrize("backend", ["redis"], indirect=True)
def test_many_gateways_with_their_own_connections_admit_exactly_the_limit(redis_backend, settings):
    """8 threads, each its own event loop and connection pool (as 8 gateway processes would)."""
    prefix = f"{settings.QUOTA_KEY_PREFIX}{{t3}}:tenant"
    spec = scope(prefix, requests_per_minute=25, max_concurrent_requests=1000)
    admitted = []
    barrier = threading.Barrier(8)

    def gateway(number: int) -> None:
        async def flood():
            results = await asyncio.gather(
                *(
                    redis_backend.admit(
                        scopes=(spec,), request_id=f"g{number}-{i}", estimated_tokens=1, clock=Clock.now()
                    )
                    for i in range(20)
                )
            )
            await redis_backend.aclose()
            return results

        barrier.wait()
        admitted.extend(r for r in asyncio.run(flood()) if r.refusal is None)

    threads = [threading.Thread(target=gateway, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert len(admitted) == 25
    assert sorted(a.states[0].requests for a in admitted) == list(range(1, 26))


def test_without_redis_url_the_backend_is_in_process(settings):
    settings.REDIS_URL = None

    assert isinstance(backends.get_backend(), MemoryQuotaBackend)
    assert backends.get_backend() is backends.get_backend()

import os
import uuid
from datetime import UTC, datetime

import pytest
import redis

from portal.quotas import backends, limits

# Mid-month, so nothing here crosses a month boundary by accident.
T0 = datetime(2031, 5, 15, 12, 0, 0, tzinfo=UTC).timestamp()


class FakeClock:
    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock(T0)
    monkeypatch.setattr(limits, "wall_clock", fake)
    return fake


def _redis_url() -> str | None:
    return os.environ.get("REDIS_URL")


@pytest.fixture(params=["memory", "redis"])
def backend(request, settings):
    """Each behavioural test runs on both backends, chosen the way production chooses: by REDIS_URL.

    Redis keys go under a prefix of this test's own, deleted afterwards (nothing else is touched).
    """
    prefix = f"loraplex:quota:test-{uuid.uuid4().hex[:12]}:"
    settings.QUOTA_KEY_PREFIX = prefix
    if request.param == "memory":
        settings.REDIS_URL = None
        chosen = backends.get_backend()
        chosen.clear()
        yield chosen
        chosen.clear()
        return
    url = _redis_url()
    if url is None:
        pytest.skip("REDIS_URL is not set")
    settings.REDIS_URL = url
    chosen = backends.get_backend()
    yield chosen
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()

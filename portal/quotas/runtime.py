"""What quota counting reads from the deployment's settings, at call time (tests change them):
where the counters live in Redis and how long a request's concurrency slot is leased."""

from __future__ import annotations

from django.conf import settings


def key_prefix() -> str:
    return settings.QUOTA_KEY_PREFIX  # from REDIS_KEY_PREFIX (portal.config)


def lease_ms() -> int:
    """A request's concurrency slot frees itself after this, settled or not (a crashed gateway)."""
    return int(settings.QUOTA_CONCURRENCY_LEASE_SECONDS * 1000)

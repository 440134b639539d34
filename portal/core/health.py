"""Liveness checks of the services the web process depends on, for /healthz.

Each check returns a plain dict: {"ok": bool, ...details}; none raises.
"""

import time
from typing import Any

import redis
from django.db import connection

REDIS_TIMEOUT_S = 1.0


def health_check_database() -> dict[str, Any]:
    backend = connection.vendor  # "postgresql" | "sqlite"
    started = time.perf_counter()
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as error:  # any failure is an unhealthy database, reported not raised
        return {"ok": False, "backend": backend, "error": _describe(error)}
    return {"ok": True, "backend": backend, "latency_ms": _ms_since(started)}


def health_check_redis(redis_url: str | None) -> dict[str, Any]:
    if not redis_url:
        return {
            "ok": True,
            "configured": False,
            "detail": "not configured (REDIS_URL unset: in-memory channel layer, tasks run in-process)",
        }
    client = redis.Redis.from_url(
        redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
    )
    started = time.perf_counter()
    try:
        client.ping()
    except Exception as error:  # any failure is an unhealthy Redis, reported not raised
        return {"ok": False, "configured": True, "error": _describe(error)}
    finally:
        client.close()
    return {"ok": True, "configured": True, "latency_ms": _ms_since(started)}


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def _describe(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:300]

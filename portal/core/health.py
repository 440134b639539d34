"""Liveness checks of the services the web process depends on, for /healthz.

Each check returns a plain dict: {"ok": bool, ...details}; none raises.
"""

import functools
import time
from typing import Any

import redis
from django.apps import apps
from django.conf import settings
from django.contrib.staticfiles import finders
from django.contrib.staticfiles.storage import ManifestFilesMixin, staticfiles_storage
from django.db import connection

REDIS_TIMEOUT_S = 1.0
MISSING_EXAMPLES = 3
COLLECT_HINT = "run `manage.py collectstatic --noinput` with the production settings, then restart the process"


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


def health_check_static() -> dict[str, Any]:
    """Whether every page can name its static files. In production each `{% static %}` looks the
    file up in the manifest loaded at start-up (STATIC_ROOT/staticfiles.json): a file without an
    entry makes every page using it a 500, so a missing or stale manifest is unhealthy."""
    if settings.WHITENOISE_USE_FINDERS:
        return {
            "ok": True,
            "storage": "finders",
            "detail": "development: static files are served from their source folders, nothing to collect",
        }
    try:
        expected = _static_source_names()
        if isinstance(staticfiles_storage, ManifestFilesMixin):
            # The manifest as the process loaded it at start-up: what the pages use.
            loaded = set(staticfiles_storage.hashed_files)
            missing = sorted(expected - loaded)
            where = f"STATIC_ROOT/{staticfiles_storage.manifest_name}"
            storage = "manifest"
        else:
            loaded = {name for name in expected if staticfiles_storage.exists(name)}
            missing = sorted(expected - loaded)
            where = "STATIC_ROOT"
            storage = "collected"
    except Exception as error:  # a broken storage is an unhealthy check, reported not raised
        return {"ok": False, "error": _describe(error)}
    if missing:
        if not loaded:
            problem = f"{where} is missing or empty"
        else:
            problem = (f"{len(missing)} of {len(expected)} static files are missing from {where}, "
                       f"e.g. {', '.join(missing[:MISSING_EXAMPLES])}")
        return {"ok": False, "storage": storage, "missing": len(missing), "error": f"{problem}: {COLLECT_HINT}"}
    return {"ok": True, "storage": storage, "files": len(expected)}


@functools.cache
def _static_source_names() -> frozenset[str]:
    """The names collectstatic collects (STATICFILES_DIRS and the apps' static/ folders, with
    its default ignore patterns): fixed for the life of the process."""
    ignore_patterns = apps.get_app_config("staticfiles").ignore_patterns
    names = set()
    for finder in finders.get_finders():
        for path, storage in finder.list(ignore_patterns):
            prefix = getattr(storage, "prefix", None)
            names.add((f"{prefix}/{path}" if prefix else path).replace("\\", "/"))
    return frozenset(names)


def _ms_since(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def _describe(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"[:300]

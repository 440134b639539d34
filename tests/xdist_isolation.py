"""Keeps pytest-xdist's test processes (`make test` runs two) out of each other's way.

Loaded with `-p tests.xdist_isolation` (the Makefile's test command), so it runs before
pytest-django reads the settings. Each process has its own PostgreSQL test database: pytest-
django appends "_gwN" to the default test database, and the directories that name their own test
database append `database_suffix()` the same way. Each process gets its own Redis database too,
REDIS_URL's number minus the process's index (wrapping at 16): rows get the same ids in every
test database, so keys derived from ids (quota counters, the usage spool, channel groups) would
otherwise meet in one Redis.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

REDIS_DATABASES = 16  # Redis's default `databases`


def worker_index() -> int:
    """N in xdist's process gwN; 0 without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0


def database_suffix() -> str:
    """"_gwN" in xdist's process gwN, "" without xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"_{worker}" if worker else ""


def redis_url_for(url: str, index: int) -> str:
    """`url` with its database number lowered by `index` (wrapping), e.g. /15 -> /14 for gw1."""
    parts = urlsplit(url)
    path = parts.path.strip("/")
    database = int(path) if path.isdigit() else 0
    return urlunsplit(parts._replace(path=f"/{(database - index) % REDIS_DATABASES}"))


if worker_index() and os.environ.get("REDIS_URL"):
    os.environ["REDIS_URL"] = redis_url_for(os.environ["REDIS_URL"], worker_index())

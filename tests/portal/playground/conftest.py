"""Playground tests: the portal's real ASGI app (portal.asgi:application) driven by channels'
WebsocketCommunicator in the test's event loop, the session cookie of a logged-in user, and a
real tiny inference worker (random Llama weights, word-level tokenizer: starts in seconds)."""

from __future__ import annotations

import time
import uuid

import pytest
from django.test import Client

from tests.inference.server.server_process import ServerProcess, start_server

BASE = "tiny-base"

@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    # Our own test database: other suites may be running at the same time on this machine.
    from django.conf import settings

    from tests.xdist_isolation import database_suffix

    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_playground{database_suffix()}"


@pytest.fixture(scope="session")
def tiny_worker(tmp_path_factory) -> ServerProcess:
    from tests.inference.server.tiny_lora import write_base

    root = tmp_path_factory.mktemp("playground")
    base = write_base(root / "base")
    proc = start_server(
        ["--model", str(base), "--served-model-name", BASE, "--dtype", "float32", "--kv-cache-memory", "4MiB",
         "--max-num-seqs", "4", "--max-lora-rank", "16"],
        root / "worker.log",
    )
    yield proc
    proc.stop()


@pytest.fixture
def live_worker(tiny_worker, transactional_db, settings) -> ServerProcess:
    """Route to the tiny worker (no fleet rows: the settings URL fallback), fresh quota counters."""
    from portal.gateway.resolve import base_model_forget

    settings.INFERENCE_URLS = [tiny_worker.url]
    settings.QUOTA_KEY_PREFIX = f"test:playground:{uuid.uuid4().hex}:"
    base_model_forget()
    return tiny_worker


def session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    from django.conf import settings

    return client.cookies[settings.SESSION_COOKIE_NAME].value


def communicator(slug: str, cookie: str | None = None, origin: bytes = b"http://testserver"):
    from channels.testing import WebsocketCommunicator
    from django.conf import settings

    from portal.asgi import application

    headers = [(b"origin", origin), (b"host", b"testserver")]
    if cookie:
        headers.append((b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()))
    return WebsocketCommunicator(application, f"/ws/t/{slug}/playground/", headers=headers)


def wait_until(predicate, timeout: float = 20, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")

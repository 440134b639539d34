"""Gateway tests: a real inference worker process (SmolLM2, loaded once per session) and the
portal's ASGI app (portal.asgi:application) served by uvicorn on a thread of this process, so
it reads the test database; clients are the official `openai` SDK and httpx.

The tests need committed rows (the server's threads cannot see a test transaction), hence
`transactional_db`. Redis counters are namespaced per test (QUOTA_KEY_PREFIX), so no state
leaks between tests or sessions."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta

import httpx
import openai
import pytest
from django.utils import timezone

from tests.inference.server.server_process import ServerProcess, start_server

BASE = "smollm2"
ADMIN_TOKEN = "gateway-test-admin"
WORKER_FLAGS = ["--served-model-name", BASE, "--dtype", "float32", "--kv-cache-memory", "64MiB",
                "--max-num-seqs", "16", "--max-waiting-requests", "64", "--max-loras", "2",
                "--max-lora-rank", "16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    # Our own test database: other suites may be running at the same time on this machine.
    from django.conf import settings

    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = "test_loraplex_gateway"


def model_path():
    from inference.models.fetch import default_model_path

    path = default_model_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m inference.models fetch` (make test does)")
    return path


def start_worker(tmp_path_factory, name: str) -> ServerProcess:
    log = tmp_path_factory.mktemp("worker") / f"{name}.log"
    return start_server(["--model", str(model_path()), *WORKER_FLAGS], log,
                        env={"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN})


@pytest.fixture(scope="session")
def worker(tmp_path_factory) -> ServerProcess:
    proc = start_worker(tmp_path_factory, "main")
    yield proc
    proc.stop()


@dataclass
class LiveGateway:
    url: str
    server: object
    thread: threading.Thread


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker) -> LiveGateway:
    """uvicorn serving portal.asgi:application on a background thread (its own event loop)."""
    import uvicorn

    from portal.asgi import application

    port = free_port()
    config = uvicorn.Config(application, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                            access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="gateway-uvicorn", daemon=True)
    with django_db_blocker.unblock():
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        yield LiveGateway(f"http://127.0.0.1:{port}", server, thread)
        server.should_exit = True
        thread.join(15)


@pytest.fixture
def live(gateway, worker, transactional_db, settings) -> LiveGateway:
    """The live gateway routed to the session's worker, with per-test quota counters."""
    from portal.gateway import services

    settings.INFERENCE_URLS = [worker.url]
    settings.INFERENCE_ADMIN_TOKEN = ADMIN_TOKEN
    settings.QUOTA_KEY_PREFIX = f"test:gateway:{uuid.uuid4().hex}:"
    services._base_cache.clear()
    return gateway


@dataclass
class Caller:
    tenant: object
    api_key: object
    key: str  # plaintext


def make_caller(slug: str, *, plan: str = "enterprise", allowed_models=None, expires_at=None) -> Caller:
    from portal.keys.services import api_key_create
    from portal.tenants.models import Tenant
    from portal.tenants.services import tenant_create

    tenant = Tenant.objects.filter(slug=slug).first() or tenant_create(slug=slug, name=slug.title())
    if tenant.plan != plan:
        tenant.plan = plan
        tenant.save(update_fields=["plan"])
    api_key, plaintext = api_key_create(tenant=tenant, name=f"{slug} key", allowed_models=allowed_models,
                                        expires_at=expires_at)
    return Caller(tenant, api_key, plaintext)


@pytest.fixture
def acme(live) -> Caller:
    return make_caller("acme")


def sdk(live: LiveGateway, key: str, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)


def usage_rows(**filters):
    from portal.usage.models import UsageRecord

    return list(UsageRecord.objects.filter(**filters).order_by("created_at"))


def wait_for_row(request_id: str, timeout: float = 20):
    """The ledger row of a request (written right after the response ends, off the request)."""
    from portal.usage.models import UsageRecord

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = UsageRecord.objects.filter(request_id=request_id).first()
        if row is not None:
            return row
        time.sleep(0.05)
    raise AssertionError(f"no usage row for {request_id}")


def wait_until(predicate, timeout: float = 20, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError("condition not met in time")


def direct(worker: ServerProcess, path: str, body: dict) -> dict:
    return httpx.post(f"{worker.url}{path}", json=body, timeout=120).json()


def run_async(coro):
    return asyncio.run(coro)


def an_hour_ago():
    return timezone.now() - timedelta(hours=1)

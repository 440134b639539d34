"""Gateway tests: a real inference worker process (SmolLM2, loaded once per session) and the
portal's ASGI app (portal.asgi:application) served by uvicorn on a thread of this process, so
it reads the test database; clients are the official `openai` SDK and httpx.

The tests need committed rows (the server's threads cannot see a test transaction), hence
`transactional_db`. Redis counters are namespaced per test (QUOTA_KEY_PREFIX), so no state
leaks between tests or sessions."""

from __future__ import annotations

import asyncio
import itertools
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

from portal.fleet.selectors import rendezvous_score
from tests.inference.server.server_process import ServerProcess, start_server

BASE = "smollm2"
ADMIN_TOKEN = "gateway-test-admin-token-0123456789abcdef"  # production wants >= 32 characters
WORKER_FLAGS = ["--served-model-name", BASE, "--dtype", "float32", "--kv-cache-memory", "64MiB",
                "--max-num-seqs", "16", "--max-waiting-requests", "64", "--max-loras", "2",
                "--max-lora-rank", "16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dead_worker_url(key: str, worker_url: str, *, above: bool) -> str:
    """A URL nothing listens on that rendezvous routing ranks above (or below) `worker_url` for
    `key`. Searched until one is found, over loopback addresses no test serves on (127.0.1.x):
    a bounded search (100 tries) failed with StopIteration about once in 100 runs, whenever the
    worker's URL happened to rank near the top (or the bottom)."""
    worker = rendezvous_score(key, worker_url)
    return next(url for url in (f"http://127.0.1.{1 + i % 250}:{free_port()}" for i in itertools.count())
                if (rendezvous_score(key, url) > worker) == above)


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    # Our own test database: other suites may be running at the same time on this machine.
    from django.conf import settings

    from tests.xdist_isolation import database_suffix

    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_gateway{database_suffix()}"


def model_path():
    from inference.models.fetch import default_model_path

    path = default_model_path()
    if not path.exists():
        pytest.fail(f"{path} is missing: run `python -m inference.models fetch` (make test does)")
    return path


def start_worker(tmp_path_factory, name: str, *, portal_url: str | None = None) -> ServerProcess:
    """The SmolLM2 worker behind ADMIN_TOKEN; it fetches adapters by URL (the gateway's lazy load
    of an uploaded version) only from `portal_url`'s origin, when given."""
    log = tmp_path_factory.mktemp("worker") / f"{name}.log"
    env = {"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN}
    if portal_url is not None:
        env["INFERENCE_PORTAL_ORIGINS"] = portal_url
    return start_server(["--model", str(model_path()), *WORKER_FLAGS], log, env=env)


@pytest.fixture(scope="session")
def gateway_port() -> int:
    """The live gateway's port, chosen before either process starts: the worker is told it
    (its portal origin) and may start first."""
    return free_port()


@pytest.fixture(scope="session")
def worker(tmp_path_factory, gateway_port) -> ServerProcess:
    proc = start_worker(tmp_path_factory, "main", portal_url=f"http://127.0.0.1:{gateway_port}")
    yield proc
    proc.stop()


@dataclass
class LiveGateway:
    url: str
    server: object
    thread: threading.Thread


@pytest.fixture(scope="session")
def gateway(django_db_setup, django_db_blocker, gateway_port) -> LiveGateway:
    """uvicorn serving portal.asgi:application on a background thread (its own event loop)."""
    import uvicorn

    from portal.asgi import application

    port = gateway_port
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
    from portal.gateway.resolve import base_model_forget

    settings.INFERENCE_URLS = [worker.url]
    settings.INFERENCE_ADMIN_TOKEN = ADMIN_TOKEN
    settings.PORTAL_INTERNAL_URL = gateway.url  # the worker's one trusted portal origin (lazy loads)
    settings.QUOTA_KEY_PREFIX = f"test:gateway:{uuid.uuid4().hex}:"
    base_model_forget()
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


# -- the web process as deployed ----------------------------------------------------------------
@pytest.fixture(scope="session")
def production_static(tmp_path_factory):
    """One production collectstatic per session (pages need the manifest; /healthz checks it)."""
    from tests.web_process import collect_static, production_env

    root = tmp_path_factory.mktemp("production-static")
    collect_static(production_env(database_url="sqlite:///unused.sqlite3", redis_url="redis://127.0.0.1:6379/0",
                                  static_root=root, storage_root=root / "unused", inference_urls=["http://x:1"],
                                  admin_token=ADMIN_TOKEN))
    return root


@pytest.fixture
def start_production_web(worker, transactional_db, production_static, tmp_path):
    """Start `uvicorn portal.asgi:application` with production settings on 127.0.0.2, on the test
    database, Redis and the session's worker; keyword arguments override its environment. The
    processes stop when the test ends."""
    from django.conf import settings

    from tests.web_process import production_env, start_web, test_database_url

    started = []

    def start(*, healthy: bool = True, **extra: str):
        env = production_env(database_url=test_database_url(), redis_url=settings.REDIS_URL,
                             static_root=production_static, storage_root=tmp_path / "storage",
                             inference_urls=[worker.url], admin_token=ADMIN_TOKEN,
                             REDIS_KEY_PREFIX=f"test:web:{uuid.uuid4().hex}:")
        env.update(extra)
        web = start_web(env, log_path=tmp_path / f"web-{len(started)}.log", healthy=healthy)
        started.append(web)
        return web

    yield start
    for web in started:
        web.stop()


def chat_prefix_key(tenant, messages: list[dict]) -> str:
    """The prompt-start key the gateway routes this tenant's base-model chat by
    (portal.gateway.relay.prompt_prefix_key; its rendezvous key is
    portal.fleet.selectors.routing_key(None, this)): tests that need a worker first in line for a
    chat pick its port by it."""
    from portal.gateway.relay import prompt_prefix_key, tenant_cache_salt
    from protocol.worker_api import CACHE_SALT

    return prompt_prefix_key({"messages": messages, CACHE_SALT: tenant_cache_salt(tenant)})

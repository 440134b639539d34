"""Browser tests: Playwright driving Debian's chromium (/usr/bin/chromium, headless) against the
portal's ASGI app (portal.asgi:application) served by uvicorn on a thread of this process (so it
reads the test database, as in tests/portal/gateway/conftest.py) and a real inference worker.

Skipped, with the reason, when chromium or the playwright package is missing:
`bash deploy/local/ensure-browser.sh` installs both. Screenshots of every page visited go to
tests/browser/artifacts/ (gitignored)."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUM = Path(os.environ.get("BROWSER_CHROMIUM", "/usr/bin/chromium"))  # Debian's package
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
PASSWORD = "browser-test-pass-1"


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (run deploy/local/ensure-browser.sh)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (run deploy/local/ensure-browser.sh)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _missing()
    if reason is None:
        return
    here = Path(__file__).resolve().parent
    for item in items:
        if here in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    from django.conf import settings

    from tests.xdist_isolation import database_suffix

    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_browser{database_suffix()}"


@pytest.fixture(scope="session")
def portal_port() -> int:
    """The live portal's port, chosen up front: the worker fetches uploaded adapters from it."""
    from tests.portal.gateway.conftest import free_port

    return free_port()


@pytest.fixture(scope="session")
def worker(tmp_path_factory, portal_port):
    from tests.portal.gateway.conftest import start_worker

    proc = start_worker(tmp_path_factory, "browser", portal_url=f"http://127.0.0.1:{portal_port}")
    yield proc
    proc.stop()


@dataclass
class LivePortal:
    url: str


@pytest.fixture(scope="session")
def portal_server(django_db_setup, django_db_blocker, portal_port) -> LivePortal:
    import uvicorn
    from django.conf import settings

    previous = settings.WHITENOISE_USE_FINDERS, getattr(settings, "WHITENOISE_AUTOREFRESH", False)
    settings.WHITENOISE_USE_FINDERS = True  # static files straight from static/ (no collectstatic)
    settings.WHITENOISE_AUTOREFRESH = True
    from portal.asgi import application

    port = portal_port
    server = uvicorn.Server(uvicorn.Config(application, host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="browser-uvicorn", daemon=True)
    with django_db_blocker.unblock():
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the portal did not start")
            time.sleep(0.02)
        yield LivePortal(f"http://127.0.0.1:{port}")
        server.should_exit = True
        thread.join(15)
    settings.WHITENOISE_USE_FINDERS, settings.WHITENOISE_AUTOREFRESH = previous


@pytest.fixture
def live(portal_server, worker, transactional_db, settings, monkeypatch, tmp_path) -> LivePortal:
    """The live portal routed to the session's worker; uploads validated in-process (eager Celery)
    against the default model's shapes."""
    from portal.celery import app
    from portal.gateway.resolve import base_model_forget

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.INFERENCE_URLS = [worker.url]
    from tests.portal.gateway.conftest import ADMIN_TOKEN  # the worker's (start_worker)

    settings.INFERENCE_ADMIN_TOKEN = ADMIN_TOKEN
    settings.QUOTA_KEY_PREFIX = f"test:browser:{uuid.uuid4().hex}:"
    storage = tmp_path / "storage"
    storage.mkdir()
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(storage)}}}
    settings.MEDIA_ROOT = str(storage)
    base_model_forget()
    # Staging after validation is not awaited here (eager Celery would run it inside the upload
    # request); the gateway loads the adapter lazily from the portal's download URL instead.
    settings.PORTAL_INTERNAL_URL = portal_server.url
    monkeypatch.setattr("portal.adapters.staging.version_stage_enqueue", lambda *, version, **kwargs: [])
    monkeypatch.setattr("portal.adapters.staging.version_unstage", lambda *, version: {})
    previous = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield portal_server
    app.conf.task_always_eager = previous


@pytest.fixture(scope="session")
def artifacts() -> Path:
    if ARTIFACTS.exists():
        shutil.rmtree(ARTIFACTS)
    ARTIFACTS.mkdir(parents=True)
    return ARTIFACTS


@pytest.fixture
def browser(live, artifacts):
    """Per test (about a second): Playwright's sync API runs an event loop on this thread while it
    lives, and the database teardown of transactional_db must not run under it."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def new_page(browser):
    """A page in a fresh browser context (its own cookies): uncaught script errors collect in
    page.js_errors, and any dialog (alert, confirm...) is dismissed and recorded in page.dialogs."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(20_000)
    page = context.new_page()
    page.js_errors = []
    page.dialogs = []
    page.on("pageerror", lambda error: page.js_errors.append(str(error)))

    def on_dialog(dialog):
        page.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.dismiss()

    page.on("dialog", on_dialog)
    return page


@pytest.fixture
def page(browser):
    page = new_page(browser)
    yield page
    page.context.close()


def shot(page, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def off_loop(fn, *args, **kwargs):
    """Run ORM code from a test: Playwright's sync API keeps an event loop running on this thread,
    where Django refuses synchronous queries, so they run on a short-lived thread (the rows are
    committed: transactional_db)."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            connection.close()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(call).result()


def wait_until(predicate, timeout_s: float = 20, interval_s: float = 0.05):
    """Poll predicate (ORM code is fine: each call runs off the loop) until it returns a truthy
    value, which is returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = off_loop(predicate)
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def make_user(username: str, tenant_roles: dict, *, staff: bool = False):
    """A user with PASSWORD who is a member of each tenant slug with the given role."""
    return off_loop(_make_user, username, tenant_roles, staff)


def _make_user(username: str, tenant_roles: dict, staff: bool = False):
    from django.contrib.auth import get_user_model

    from portal.tenants.models import Tenant
    from portal.tenants.services import membership_create, tenant_create

    user = get_user_model().objects.create_user(username=username, password=PASSWORD, is_staff=staff)
    for slug, role in tenant_roles.items():
        tenant = Tenant.objects.filter(slug=slug).first() or tenant_create(slug=slug, name=f"{slug.title()} Inc")
        membership_create(tenant=tenant, user=user, role=role)
    return user


def log_in(page, live: LivePortal, username: str) -> None:
    page.goto(f"{live.url}/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{live.url}/t/")

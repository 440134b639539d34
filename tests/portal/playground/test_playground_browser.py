"""The playground's script in a real browser (Debian chromium, headless, driven by Playwright)
against the portal served by uvicorn: tokens stream into the page, Stop ends the generation,
markup typed by the user or produced by a model stays text, and the stats line shows time to
first token and tokens/s. The staff dashboards draw their charts without console errors.
Skipped when chromium or playwright is missing (deploy/local/ensure-browser.sh installs them)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from tests.portal.playground.conftest import session_cookie

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


def _missing() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (run deploy/local/ensure-browser.sh)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (run deploy/local/ensure-browser.sh)"
    return None


pytestmark = pytest.mark.skipif(_missing() is not None, reason=str(_missing()))


@pytest.fixture
def portal_url(live_worker):
    import uvicorn
    from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

    from portal.asgi import application
    from tests.inference.server.server_process import free_port

    port = free_port()
    # static files from the finders (no collectstatic), whatever WhiteNoise was set up with
    server = uvicorn.Server(uvicorn.Config(ASGIStaticFilesHandler(application), host="127.0.0.1", port=port, lifespan="off",
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, name="playground-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the portal did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(15)


def test_playground_streams_stops_and_renders_text_only(portal_url, django_user_model, tmp_path):
    from playwright.sync_api import sync_playwright

    tenant = tenant_create(slug="acme", name="Acme <b>Corp</b>", plan="team")
    user = django_user_model.objects.create_user(username="ada", password="x", is_staff=True)
    membership_create(tenant=tenant, user=user, role=Membership.Role.OWNER)
    cookie = session_cookie(user)
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        context.add_cookies([{"name": "sessionid", "value": cookie, "url": portal_url}])
        page = context.new_page()
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("dialog", lambda d: errors.append(f"dialog: {d.message}"))
        page.goto(f"{portal_url}/t/acme/playground/")
        status = page.locator("#pg-status")
        page.wait_for_function("document.getElementById('pg-status').textContent === 'connected'")

        page.fill("#pg-input", "t5 t6 <img src=x onerror=alert(1)>")
        page.fill("#pg-max-tokens", "240")
        page.click("#pg-send")
        answer = page.locator(".pg-msg.assistant .text").first
        page.wait_for_function("document.querySelector('.pg-msg.assistant .text').textContent.length > 8")
        assert page.locator("#pg-stop").is_enabled() and page.locator("#pg-send").is_disabled()
        page.click("#pg-stop")
        page.wait_for_function("document.getElementById('pg-status').textContent === 'stopped'")
        stopped_at = answer.text_content()
        page.wait_for_timeout(300)
        assert answer.text_content() == stopped_at  # nothing arrives after Stop
        page.screenshot(path=str(tmp_path / "playground-stopped.png"), full_page=True)

        page.fill("#pg-input", "t9")
        page.fill("#pg-max-tokens", "6")
        page.click("#pg-send")
        page.wait_for_function("document.getElementById('pg-status').textContent.startsWith('done')")
        assert "time to first token" in page.locator("#pg-stats").text_content()
        assert "tokens/s" in page.locator("#pg-stats").text_content()
        assert status.text_content() == "done (max tokens reached)"
        # what the user typed is shown as text, never parsed: no <img> (and no alert) in the page
        assert page.locator(".pg-msg.user .text").first.text_content() == "t5 t6 <img src=x onerror=alert(1)>"
        assert page.locator("#pg-log img").count() == 0
        assert "Acme <b>Corp</b>" in page.locator("h1").text_content()
        page.screenshot(path=str(tmp_path / "playground-done.png"), full_page=True)

        for name in ("", "tenants/", "latency/", "adapters/", "billing/"):
            page.goto(f"{portal_url}/dashboards/{name}")
            page.wait_for_load_state("networkidle")
            assert page.locator("p.bad").count() == 0, name  # a chart that failed to load says so
        browser.close()
    assert [e for e in errors if "favicon" not in e and "404" not in e] == []

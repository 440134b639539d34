"""The OpenAPI docs page (/api/docs/) in a real browser: Swagger UI renders the schema's
operations from the portal's own static files (drf-spectacular-sidecar), and the browser asks
nothing of any other host, so the page works offline. Every request the page makes is recorded
through Playwright's request events. No inference worker is needed."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest

from tests.browser.conftest import CHROMIUM, CHROMIUM_ARGS, log_in, make_user, new_page, shot


@pytest.fixture
def docs_browser(portal_server, transactional_db, artifacts):
    """Chromium against the live portal alone (the `browser` fixture also starts a worker)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def test_swagger_ui_lists_the_operations_with_no_request_to_another_host(portal_server, docs_browser, settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    make_user("docs-reader", {"acme": "member"})
    page = new_page(docs_browser)
    requests: list[str] = []
    page.context.on("request", lambda request: requests.append(request.url))
    log_in(page, portal_server, "docs-reader")

    page.goto(f"{portal_server.url}/api/docs/")
    page.wait_for_selector(".swagger-ui .opblock")
    page.wait_for_load_state("networkidle")
    shot(page, "api-docs")

    assert "Loraplex API" in page.locator(".swagger-ui .info .title").inner_text()
    paths = page.locator(".swagger-ui .opblock .opblock-summary-path").all_inner_texts()
    assert any(p.startswith("/api/v1/tenants/{tenant_slug}/adapters/") for p in paths), paths
    assert len(paths) >= 5
    assert not page.js_errors

    portal = urlsplit(portal_server.url).netloc
    fetched = [url for url in requests if urlsplit(url).scheme in ("http", "https", "ws", "wss")]
    assert any("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle" in url for url in fetched)
    assert any(urlsplit(url).path == "/api/schema/" for url in fetched)
    elsewhere = [url for url in fetched if urlsplit(url).netloc != portal]
    assert not elsewhere, f"the docs page asked other hosts: {elsewhere}"
    page.context.close()

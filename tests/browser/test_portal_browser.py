"""The tenant portal in a real browser (Debian chromium via Playwright) against the live ASGI app
and a real inference worker. Every page visited is saved under tests/browser/artifacts/."""

from __future__ import annotations

import re

import httpx
import pytest

from portal.adapters.validation import SMOLLM2_135M
from tests.browser.conftest import log_in, make_user, off_loop, shot
from tests.portal.adapters.peft_files import peft_config, write_peft

pytestmark = pytest.mark.slow


def _wait_for_status(page, number: int, status: str, timeout_s: float = 60) -> None:
    """The page polls the status API and reloads when a version settles."""
    page.wait_for_selector(f"#version-{number}[data-status={status}]", timeout=timeout_s * 1000)


def test_member_journey_key_upload_ready_usage(live, page, tmp_path):
    make_user("mia", {"acme": "owner", "globex": "member"})
    page.goto(f"{live.url}/login/")
    shot(page, "01-login")
    page.fill("#id_username", "mia")
    page.fill("#id_password", "wrong password")
    page.click("button[type=submit]")
    assert "correct username and password" in page.inner_text(".form-errors")
    page.fill("#id_password", "browser-test-pass-1")
    page.click("button[type=submit]")
    page.wait_for_url(f"{live.url}/t/")
    assert "Acme Inc" in page.inner_text("main") and "Globex Inc" in page.inner_text("main")
    shot(page, "02-tenant-picker")

    page.click(".tenant-list >> text=Acme Inc")
    page.wait_for_url(f"{live.url}/t/acme/")
    assert page.inner_text("#stat-requests") == "0"
    shot(page, "03-overview-empty")
    # Switching tenant with the header's select.
    page.select_option("#tenant-switch", label="Globex Inc")
    page.wait_for_url(f"{live.url}/t/globex/")
    page.goto(f"{live.url}/t/acme/keys/")

    # API key: the secret is shown once.
    page.fill("#id_name", "")
    page.click("text=Create key")
    assert "This field is required." in page.inner_text(".field.has-error")
    shot(page, "04-keys-inline-error")
    page.fill("#id_name", "browser <key>")
    page.click("text=Create key")
    secret = page.inner_text("#new-key-secret").strip()
    assert secret.startswith("sk-")
    shot(page, "05-keys-secret-once")
    page.goto(f"{live.url}/t/acme/keys/")
    assert secret not in page.content() and "browser <key>" in page.inner_text("table")

    # Adapter: create, upload a valid version with the progress bar, watch it become ready.
    page.goto(f"{live.url}/t/acme/adapters/")
    shot(page, "06-adapters-empty")
    page.fill("#id_name", "support-bot")
    page.fill("#id_description", "Answers <b>support</b> questions")
    page.click("text=Create adapter")
    page.wait_for_url(f"{live.url}/t/acme/adapters/support-bot/")
    good = write_peft(tmp_path / "good", SMOLLM2_135M)
    page.set_input_files("#id_files", [str(good / "adapter_config.json"), str(good / "adapter_model.safetensors")])
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector("#upload-progress:not([hidden])")
    _wait_for_status(page, 1, "ready")
    assert "serving" in page.inner_text("#version-1")
    assert page.locator("#upload-error").is_hidden()
    shot(page, "07-adapter-ready")

    # An invalid upload (rank over the fleet's maximum) shows its reason.
    bad = write_peft(tmp_path / "bad", SMOLLM2_135M, config=peft_config(r=32), rank=32)
    page.set_input_files("#id_files", [str(bad / "adapter_config.json"), str(bad / "adapter_model.safetensors")])
    page.click("#upload-form button[type=submit]")
    _wait_for_status(page, 2, "rejected")
    reasons = page.inner_text("#version-2 .reasons")
    assert re.search(r"rank", reasons), reasons
    shot(page, "08-adapter-rejected-reason")

    # Refused at once by the API (not a PEFT pair): the reason shows under the form, as text.
    notes = tmp_path / "notes.txt"
    notes.write_text("<b>not an adapter</b>")
    page.set_input_files("#id_files", [str(notes)])
    page.click("#upload-form button[type=submit]")
    page.wait_for_selector("#upload-error:not([hidden])")
    assert page.inner_text("#upload-error").strip()
    assert page.locator("#upload-error b").count() == 0
    shot(page, "08b-upload-refused")

    # A request through the gateway with the new key, on the real worker, then the usage page.
    with httpx.Client(base_url=f"{live.url}/v1", headers={"Authorization": f"Bearer {secret}"}, timeout=120) as api:
        models = api.get("/models").json()["data"]
        base = models[0]["id"]
        reply = api.post("/chat/completions", json={
            "model": base, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert reply.status_code == 200, reply.text
        tuned = api.post("/chat/completions", json={
            "model": "acme/support-bot", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4})
        assert tuned.status_code == 200, tuned.text
    page.goto(f"{live.url}/t/acme/usage/")
    page.wait_for_selector("#chart-daily[data-ready='1']")
    page.wait_for_selector("#chart-models[data-ready='1']")
    assert base in page.inner_text("#usage-by-model") and "acme/support-bot" in page.inner_text("#usage-by-model")
    chart = page.evaluate("document.getElementById('chart-daily').chart.data.datasets[2].data.slice(-1)[0]")
    assert chart == 2
    labels = page.evaluate("document.getElementById('chart-models').chart.data.labels")
    assert sorted(labels) == sorted([base, "acme/support-bot"])
    shot(page, "09-usage-with-chart")
    page.goto(f"{live.url}/t/acme/")
    assert page.inner_text("#stat-requests") == "2"
    shot(page, "10-overview")
    page.goto(f"{live.url}/t/acme/billing/")
    assert base in page.inner_text("#statement")
    shot(page, "11-billing")
    assert page.js_errors == []


def test_member_of_a_gets_404_on_b(live, page):
    make_user("ann", {"acme": "member"})
    make_user("bob", {"globex": "owner"})
    log_in(page, live, "ann")
    for path in ("/t/globex/", "/t/globex/keys/", "/t/globex/adapters/", "/t/globex/usage/", "/t/globex/billing/"):
        response = page.goto(f"{live.url}{path}")
        assert response.status == 404, path
        assert "Globex" not in page.content()
    shot(page, "12-other-tenant-404")


def test_viewer_cannot_create_keys(live, page):
    make_user("vic", {"acme": "viewer"})
    log_in(page, live, "vic")
    page.goto(f"{live.url}/t/acme/keys/")
    assert page.locator("text=Create key").count() == 0
    assert "not create or revoke" in page.inner_text(".note")
    shot(page, "13-viewer-keys")
    # Even a hand-made POST (with a valid CSRF token) is refused with a message.
    with page.expect_navigation():
        page.evaluate("""() => {
            const form = document.createElement('form');
            form.method = 'post'; form.action = location.pathname;
            const token = document.querySelector('input[name=csrfmiddlewaretoken]').cloneNode();
            const name = document.createElement('input'); name.name = 'name'; name.value = 'sneaky';
            form.append(token, name); document.body.append(form); form.submit();
        }""")
    assert "read-only" in page.inner_text("main")
    shot(page, "14-viewer-403")
    from portal.keys.models import ApiKey

    assert not off_loop(lambda: ApiKey.objects.filter(name="sneaky").exists())

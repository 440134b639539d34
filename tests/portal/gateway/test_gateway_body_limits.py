"""Bodies are paid for before they are read: a /v1 request's key is checked and its size bounded
from the headers alone (401 / 413 at once, nothing spooled), a body that lies about its length or
stalls is cut off (413 / 408), and an authenticated refusal still leaves its ledger row. The
portal's own routes (uploads) take a large body only from a signed-in user or an API key."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlsplit

import httpx
import pytest

from portal.core.body_guard import BodyRejected, GuardedASGIHandler, declared_length
from tests.portal.gateway.conftest import BASE, make_caller

CHAT = json.dumps({"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
HUGE = 300 << 20  # what an attacker claims to send


def send_partial(url: str, path: str, *, headers: dict[str, str], body: bytes, timeout: float = 20):
    """Send the request line, headers and only `body` (whatever Content-Length says), then read the
    answer: (status, headers, parsed JSON or text, seconds from the last byte sent to the answer)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.putrequest("POST", path, skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        if body:
            connection.send(body)
        sent = time.monotonic()
        response = connection.getresponse()
        raw = response.read()
        elapsed = time.monotonic() - sent
        content_type = response.getheader("content-type", "")
        payload = json.loads(raw) if content_type.startswith("application/json") else raw.decode()
        return response.status, dict(response.getheaders()), payload, elapsed
    finally:
        connection.close()


def assert_openai_error(payload: dict, code: str) -> None:
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["code"] == code


def test_an_unauthenticated_huge_body_is_refused_before_it_is_read(live):
    status, headers, payload, elapsed = send_partial(
        live.url, "/v1/chat/completions",
        headers={"content-type": "application/json", "content-length": str(HUGE)}, body=b"{" + b" " * 4096)

    assert status == 401 and elapsed < 5
    assert_openai_error(payload, "invalid_api_key")
    assert headers["x-request-id"].startswith("req_")


def test_a_wrong_key_with_a_body_is_refused_before_it_is_read(live):
    status, _, payload, elapsed = send_partial(
        live.url, "/v1/completions",
        headers={"authorization": "Bearer sk-not-a-key", "content-length": str(HUGE)}, body=b"x" * 100)

    assert status == 401 and elapsed < 5
    assert_openai_error(payload, "invalid_api_key")


def test_a_declared_length_over_the_limit_is_413_at_once_and_on_the_ledger(live):
    from portal.usage.models import UsageRecord

    caller = make_caller("acme")
    status, headers, payload, elapsed = send_partial(
        live.url, "/v1/chat/completions",
        headers={"authorization": f"Bearer {caller.key}", "content-length": str(2 << 30)}, body=b"x" * 100)

    assert status == 413 and elapsed < 5
    assert_openai_error(payload, "request_too_large")
    row = UsageRecord.objects.get(request_id=headers["x-request-id"])
    assert row.status_code == 413 and row.tenant_id == caller.tenant.pk
    assert row.prompt_tokens == row.completion_tokens == 0


def test_a_chunked_body_past_the_limit_is_cut_off(live, settings):
    from portal.usage.models import UsageRecord

    settings.GATEWAY_MAX_BODY_BYTES = 64 << 10
    caller = make_caller("acme")

    def chunks():
        yield b'{"model": "' + BASE.encode() + b'", "prompt": "'
        for _ in range(200):  # 200 × 4 KiB: three times the limit, no Content-Length
            yield b"a" * 4096
        yield b'"}'

    response = httpx.post(f"{live.url}/v1/completions", content=chunks(), timeout=30,
                          headers={"authorization": f"Bearer {caller.key}", "content-type": "application/json"})

    assert response.status_code == 413
    assert_openai_error(response.json(), "request_too_large")
    assert "65536 bytes" in response.json()["error"]["message"]
    row = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert row.status_code == 413


def test_a_body_within_the_limit_is_served(live, settings):
    settings.GATEWAY_MAX_BODY_BYTES = 64 << 10
    caller = make_caller("acme")
    body = CHAT + b" " * (60 << 10)  # just under the limit (JSON allows trailing whitespace)

    response = httpx.post(f"{live.url}/v1/chat/completions", timeout=120, content=body,
                          headers={"authorization": f"Bearer {caller.key}", "content-type": "application/json"})

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


def test_a_stalled_body_gets_408(live, monkeypatch):
    from portal.usage.models import UsageRecord

    monkeypatch.setattr(GuardedASGIHandler, "idle_timeout", 1.0)
    caller = make_caller("acme")
    status, headers, payload, elapsed = send_partial(
        live.url, "/v1/chat/completions",
        headers={"authorization": f"Bearer {caller.key}", "content-length": "1000"}, body=CHAT[:20])

    assert status == 408 and 0.5 < elapsed < 10
    assert_openai_error(payload, "request_timeout")
    assert UsageRecord.objects.get(request_id=headers["x-request-id"]).status_code == 408


@pytest.mark.parametrize("value", [b"abc", b"-1", b"1e9", b""])
def test_a_malformed_content_length_is_refused(value):
    # uvicorn already refuses most of these itself; another server might pass them on.
    with pytest.raises(BodyRejected) as info:
        declared_length({"headers": [(b"Content-Length", value)]})
    assert info.value.status == 400 and info.value.code == "invalid_content_length"


def test_the_portal_takes_a_large_body_only_after_authentication(live, settings):
    caller = make_caller("acme")
    path = "/api/v1/tenants/acme/adapters/bot/versions/"

    status, _, payload, elapsed = send_partial(
        live.url, path, headers={"content-type": "multipart/form-data; boundary=x", "content-length": str(HUGE)},
        body=b"--x\r\n" + b" " * 4096)
    assert status == 401 and elapsed < 5
    assert payload["code"] == "not_authenticated"

    settings.MAX_UPLOAD_BYTES = 10 << 20
    status, _, payload, elapsed = send_partial(
        live.url, path, headers={"authorization": f"Bearer {caller.key}", "content-length": str(HUGE),
                                 "content-type": "multipart/form-data; boundary=x"}, body=b"--x\r\n")
    assert status == 413 and elapsed < 5
    assert payload["code"] == "request_too_large"

    # A small anonymous body (a sign-in form, a JSON call) still reaches its view.
    response = httpx.post(f"{live.url}/api/v1/tenants/acme/adapters/", json={"name": "bot"}, timeout=30)
    assert response.status_code in (401, 403)
    assert response.json()["detail"]


def test_a_signed_in_user_uploads_more_than_an_anonymous_body(live, django_user_model, tmp_path):
    """The session cookie is checked before the body is read; the upload then reaches its view
    (a save_pretrained directory with a 1.5 MiB model card: the card ignored, the version made)."""
    from django.test import Client

    from portal.adapters.models import AdapterVersion
    from portal.adapters.services import adapter_create
    from portal.tenants.services import membership_create
    from tests.portal.adapters.peft_files import write_peft

    caller = make_caller("acme")
    user = django_user_model.objects.create_user(username="mia", password="pw-mia-correct-horse")
    membership_create(tenant=caller.tenant, user=user, role="admin")
    adapter_create(tenant=caller.tenant, name="bot", actor=user)
    browser = Client()
    browser.force_login(user)
    csrf = "a" * 32
    cookies = {"sessionid": browser.cookies["sessionid"].value, "csrftoken": csrf}
    directory = write_peft(tmp_path / "bot")
    files = [("files", (name, (directory / name).read_bytes())) for name in ("adapter_config.json",
                                                                             "adapter_model.safetensors")]
    files.append(("files", ("README.md", b"# bot\n" + b"A long model card.\n" * 90_000)))

    anonymous = httpx.post(f"{live.url}/api/v1/tenants/acme/adapters/bot/versions/", files=files, timeout=60)
    assert anonymous.status_code == 401 and anonymous.json()["code"] == "not_authenticated"

    signed_in = httpx.post(f"{live.url}/api/v1/tenants/acme/adapters/bot/versions/", files=files, timeout=60,
                           cookies=cookies, headers={"x-csrftoken": csrf, "referer": live.url})
    assert signed_in.status_code == 202, signed_in.text  # accepted; validation follows
    version = AdapterVersion.objects.get(adapter__name="bot")
    stored = sum(len(content) for _, (name, content) in files if name != "README.md")
    assert version.size_bytes == stored  # the two adapter files, not the card

"""The console's forms: keys (secret once, revoke, viewers refused), adapters (create, upload
through the plain form, rejection reasons, weights, rollback, always-warm), inline errors, and
the usage charts' JSON."""

from __future__ import annotations

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse

from portal.adapters.models import AdapterVersion
from portal.adapters.services import adapter_create, adapter_version_upload
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate
from portal.tenants.models import Tenant
from portal.usage.services import usage_record_create
from tests.portal.adapters.peft_files import peft_config, write_peft

pytestmark = pytest.mark.django_db


def _files(directory):
    return [
        SimpleUploadedFile(name, (directory / name).read_bytes(), content_type="application/octet-stream")
        for name in ("adapter_config.json", "adapter_model.safetensors")
    ]


# --- keys ----------------------------------------------------------------------------------------


def test_created_key_secret_is_shown_once(mia, tenant):
    url = reverse("console:keys", args=[tenant.slug])
    response = mia.post(url, {"name": "ci runner"})
    assert response.status_code == 200
    secret = response.context["created"]["plaintext"]
    assert secret.encode() in response.content
    assert response["Cache-Control"] == "no-store"
    assert api_key_authenticate(secret).name == "ci runner"
    again = mia.get(url)
    assert b"ci runner" in again.content and secret.encode() not in again.content


def test_key_form_shows_inline_errors(mia, tenant):
    url = reverse("console:keys", args=[tenant.slug])
    blank = mia.post(url, {"name": ""})
    assert blank.status_code == 400
    assert b'class="error"' in blank.content and b"This field is required." in blank.content
    past = mia.post(url, {"name": "old", "expires_at": "2001-01-01 00:00"})
    assert past.status_code == 400 and b"must be in the future" in past.content
    assert not ApiKey.objects.exists()


def test_revoke_key_with_post(mia, tenant, member):
    mia.post(reverse("console:keys", args=[tenant.slug]), {"name": "k"})
    key = ApiKey.objects.get()
    assert mia.get(reverse("console:key-revoke", args=[tenant.slug, key.pk])).status_code == 405
    response = mia.post(reverse("console:key-revoke", args=[tenant.slug, key.pk]), follow=True)
    assert b"Revoked the key" in response.content
    key.refresh_from_db()
    assert key.revoked_at is not None


def test_revoke_needs_csrf(member, tenant):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(member)
    client.post(reverse("console:keys", args=[tenant.slug]), {"name": "k"})  # refused too: no token
    assert not ApiKey.objects.exists()


def test_viewer_cannot_create_or_revoke_keys(viewer, member, tenant, client_for):
    client = client_for(viewer)
    page = client.get(reverse("console:keys", args=[tenant.slug]))
    assert page.status_code == 200 and b"Create key" not in page.content and b"not create or revoke" in page.content
    refused = client.post(reverse("console:keys", args=[tenant.slug]), {"name": "sneaky"})
    assert refused.status_code == 403
    assert b"read-only" in refused.content
    assert not ApiKey.objects.filter(name="sneaky").exists()
    client_for(member).post(reverse("console:keys", args=[tenant.slug]), {"name": "theirs"})
    key = ApiKey.objects.get(name="theirs")
    assert client.post(reverse("console:key-revoke", args=[tenant.slug, key.pk])).status_code == 403
    key.refresh_from_db()
    assert key.revoked_at is None


def test_cannot_revoke_another_tenants_key(mia, tenant, other_tenant):
    from portal.keys.services import api_key_create

    key, _ = api_key_create(tenant=other_tenant, name="theirs")
    assert mia.post(reverse("console:key-revoke", args=[tenant.slug, key.pk])).status_code == 404
    key.refresh_from_db()
    assert key.revoked_at is None


# --- adapters ------------------------------------------------------------------------------------


def test_create_adapter_and_inline_errors(mia, tenant):
    url = reverse("console:adapters", args=[tenant.slug])
    created = mia.post(url, {"name": "support-bot", "description": "helps"})
    assert created.status_code == 302 and created["Location"].endswith("/adapters/support-bot/")
    duplicate = mia.post(url, {"name": "support-bot"})
    assert duplicate.status_code == 400 and b"already has an adapter named" in duplicate.content
    bad = mia.post(url, {"name": "Bad Name!"})
    assert bad.status_code == 400 and b"lowercase" in bad.content


def test_upload_via_the_form_creates_a_ready_version(mia, tenant, member, tmp_path, on_commit):
    adapter_create(tenant=tenant, name="bot", actor=member)
    directory = write_peft(tmp_path / "good")
    with on_commit(execute=True):
        response = mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]), {"files": _files(directory)})
    assert response.status_code == 302
    version = AdapterVersion.objects.get(adapter__name="bot")
    assert version.number == 1 and version.status == AdapterVersion.Status.READY
    page = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"badge-ready" in page.content and b"serving" in page.content


def test_invalid_upload_shows_its_reasons(mia, tenant, member, tmp_path, on_commit):
    adapter_create(tenant=tenant, name="bot", actor=member)
    directory = write_peft(tmp_path / "bad", config=peft_config(r=64), rank=64)
    with on_commit(execute=True):
        mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]), {"files": _files(directory)})
    version = AdapterVersion.objects.get()
    assert version.status == AdapterVersion.Status.REJECTED and version.rejection_reasons
    page = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"badge-rejected" in page.content
    assert version.rejection_reasons[0].encode() in page.content.replace(b"&#x27;", b"'")


def test_upload_form_without_files_is_an_inline_error(mia, tenant, member):
    adapter_create(tenant=tenant, name="bot", actor=member)
    response = mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]), {})
    assert response.status_code == 400 and b"Choose adapter_config.json" in response.content
    one = mia.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]),
                   {"files": [SimpleUploadedFile("notes.txt", b"hi")]})
    assert one.status_code == 400 and b'class="error"' in one.content
    assert not AdapterVersion.objects.exists()


def test_viewer_cannot_upload(viewer, tenant, member, client_for, tmp_path):
    adapter_create(tenant=tenant, name="bot", actor=member)
    client = client_for(viewer)
    page = client.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"upload-form" not in page.content
    response = client.post(reverse("console:adapter-upload", args=[tenant.slug, "bot"]),
                           {"files": _files(write_peft(tmp_path / "g"))})
    assert response.status_code == 403 and not AdapterVersion.objects.exists()


def _two_ready_versions(tenant, member, tmp_path, on_commit):
    adapter = adapter_create(tenant=tenant, name="bot", actor=member)
    for seed in (1, 2):
        with on_commit(execute=True):
            adapter_version_upload(adapter=adapter, files=_files(write_peft(tmp_path / f"v{seed}", seed=seed)),
                                   actor=member)
    assert adapter.versions.filter(status="ready").count() == 2
    return adapter


def test_weights_editor_and_rollback(mia, tenant, member, tmp_path, on_commit):
    adapter = _two_ready_versions(tenant, member, tmp_path, on_commit)
    url = reverse("console:adapter-deployment", args=[tenant.slug, "bot"])
    split = mia.post(url, {"weight_1": "90", "weight_2": "10"})
    assert split.status_code == 302
    adapter.deployment.refresh_from_db()
    assert adapter.deployment.weights == {"1": 90, "2": 10}
    negative = mia.post(url, {"weight_1": "-1", "weight_2": "10"})
    assert negative.status_code == 400 and b"greater than or equal to 0" in negative.content
    rollback = mia.post(url, {"weight_1": "100"})  # what the "Roll back to v1" button posts
    assert rollback.status_code == 302
    adapter.deployment.refresh_from_db()
    assert adapter.deployment.weights == {"1": 100}


def test_always_warm_only_where_the_plan_allows(mia, tenant, member, tmp_path, on_commit):
    _two_ready_versions(tenant, member, tmp_path, on_commit)
    page = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"does not include always-warm" in page.content and b"Keep warm" not in page.content
    refused = mia.post(reverse("console:adapter-always-warm", args=[tenant.slug, "bot"]), {"enabled": "1"},
                       follow=True)
    assert b"allows 0 always-warm" in refused.content
    Tenant.objects.filter(pk=tenant.pk).update(plan="team")
    page = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"Keep warm" in page.content
    mia.post(reverse("console:adapter-always-warm", args=[tenant.slug, "bot"]), {"enabled": "1"})
    page = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert b"Stop keeping warm" in page.content


# --- usage JSON ----------------------------------------------------------------------------------


def test_usage_chart_json_shapes(mia, tenant):
    usage_record_create(request_id="r1", tenant=tenant, model="acme/bot", prompt_tokens=7, completion_tokens=3,
                        time_to_first_token_ms=12.0, latency_ms=40.0)
    usage_record_create(request_id="r2", tenant=tenant, model="SmolLM2-135M-Instruct", prompt_tokens=1,
                        completion_tokens=1, latency_ms=5.0)
    daily = mia.get(reverse("console:usage-daily-json", args=[tenant.slug]) + "?days=7").json()
    assert set(daily) == {"start", "end", "labels", "requests", "errors", "prompt_tokens", "completion_tokens"}
    assert len(daily["labels"]) == 7 and daily["labels"][-1] == daily["end"]
    assert daily["requests"][-1] == 2 and daily["prompt_tokens"][-1] == 8  # today, live from the ledger
    models = mia.get(reverse("console:usage-models-json", args=[tenant.slug])).json()
    assert models["labels"] == ["acme/bot", "SmolLM2-135M-Instruct"] and models["total_tokens"] == [10, 2]
    page = mia.get(reverse("console:usage", args=[tenant.slug]))
    assert page.context["latency"]["requests"] == 2
    assert b"records.csv" in page.content and b"statement/" in page.content
    assert b"vendor/chartjs/chart.umd.min.js" in page.content


def test_suspended_tenant_is_read_only(mia, tenant):
    Tenant.objects.filter(pk=tenant.pk).update(status="suspended")
    assert b"suspended" in mia.get(reverse("console:overview", args=[tenant.slug])).content
    refused = mia.post(reverse("console:keys", args=[tenant.slug]), {"name": "k"})
    assert refused.status_code == 403 and b"suspended" in refused.content
    assert not ApiKey.objects.exists()

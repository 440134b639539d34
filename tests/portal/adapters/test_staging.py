"""Staging over real HTTP against loopback stand-in workers: the load body (path or portal URL +
sha256 + token), one task per enabled worker after commit, per-worker status, retries with
exponential backoff on transient failures only, concurrent status merges, unstaging; and the
internal download endpoint the workers fetch from (auth, nothing served without a token, 404s,
streamed bytes under WSGI and ASGI)."""

from __future__ import annotations

import hashlib
import threading

import pytest
from django.core.files.base import ContentFile
from django.core.files.storage import default_storage
from django.db import connection

from portal.adapters import staging, tasks
from portal.adapters.models import Adapter, AdapterVersion, Deployment
from portal.adapters.services import adapter_version_retire
from portal.fleet.client import version_load_body
from portal.fleet.models import InferenceWorker
from tests.portal.adapters.test_staging_fakes import FakeWorker, error

TOKEN = "fleet-secret"
CONFIG = b'{"peft_type": "LORA", "r": 4}'
WEIGHTS = bytes(range(256)) * 300  # bigger than one streamed chunk


pytestmark = pytest.mark.real_staging


@pytest.fixture(autouse=True)
def fleet_settings(settings):
    settings.INFERENCE_ADMIN_TOKEN = TOKEN
    settings.PORTAL_INTERNAL_URL = "http://portal.internal:8000/"
    settings.INFERENCE_URLS = []


@pytest.fixture
def fakes():
    workers = [FakeWorker(), FakeWorker()]
    yield workers
    for w in workers:
        w.close()


@pytest.fixture
def rows(db, fakes):
    return [InferenceWorker.objects.create(url=w.url, name=f"w{i}", healthy=True) for i, w in enumerate(fakes)]


def make_version(tenant, *, name="bot", number=1, status=AdapterVersion.Status.READY, stored=True, **fields):
    adapter, _ = Adapter.objects.get_or_create(tenant=tenant, name=name)
    Deployment.objects.get_or_create(adapter=adapter)
    version = AdapterVersion.objects.create(adapter=adapter, number=number, status=status, **fields)
    if stored:
        version.storage_dir = f"adapters/{version.uid.hex}"
        version.file_sha256 = {}
        for filename, data in (("adapter_config.json", CONFIG), ("adapter_model.safetensors", WEIGHTS)):
            default_storage.save(f"{version.storage_dir}/{filename}", ContentFile(data))
            version.file_sha256[filename] = hashlib.sha256(data).hexdigest()
        version.save()
    return version


# --- the load body ------------------------------------------------------------------------------


def test_load_body_names_the_portal_url_the_sha256_and_the_token(db, tenant):
    version = make_version(tenant)
    body = version_load_body(version=version).to_json()
    assert body == {
        "lora_name": version.worker_name,
        "lora_url": f"http://portal.internal:8000/internal/adapters/{version.uid}/",
        "files": version.file_sha256,
        "auth_token": TOKEN,
    }


def test_load_body_of_a_staff_registered_version_is_its_path(db, tenant, settings):
    version = make_version(tenant, stored=False, source_path="/models/adapters/bot")
    assert version_load_body(version=version).to_json() == {"lora_name": version.worker_name,
                                                          "lora_path": "/models/adapters/bot"}
    settings.INFERENCE_ADMIN_TOKEN = None
    settings.PORTAL_INTERNAL_URL = "http://portal.internal:8000/"
    body = version_load_body(version=make_version(tenant, number=2)).to_json()
    assert "auth_token" not in body and body["lora_url"].startswith("http://portal.internal:8000/internal/adapters/")


# --- staging ------------------------------------------------------------------------------------


def test_stage_enqueue_loads_on_every_enabled_worker_after_commit(tenant, rows, fakes,
                                                                  django_capture_on_commit_callbacks):
    disabled = FakeWorker()
    try:
        InferenceWorker.objects.create(url=disabled.url, enabled=False)
        version = make_version(tenant)
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            assert staging.version_stage_enqueue(version=version) == sorted(w.url for w in fakes)
        version.refresh_from_db()
        assert {u: e["status"] for u, e in version.staging.items()} == {w.url: "pending" for w in fakes}
        assert not fakes[0].requests  # nothing is sent before the commit
        for callback in callbacks:
            callback()
        version.refresh_from_db()
        for w in fakes:
            [(path, body, auth)] = w.requests
            assert path == "/v1/load_lora_adapter" and auth == f"Bearer {TOKEN}"
            assert body == version_load_body(version=version).to_json()
            entry = version.staging[w.url]
            assert entry["status"] == "staged" and entry["attempts"] == 1 and entry["error"] == ""
            assert entry["pinned"] is False and entry["at"]
        assert not disabled.requests
    finally:
        disabled.close()


def test_only_ready_versions_are_staged(tenant, rows, fakes, django_capture_on_commit_callbacks):
    for i, status in enumerate(["uploaded", "validating", "rejected", "retired"], start=1):
        version = make_version(tenant, number=i, status=status)
        with django_capture_on_commit_callbacks(execute=True):
            assert staging.version_stage_enqueue(version=version) == []
    assert not fakes[0].requests and not fakes[1].requests


def test_without_worker_rows_the_settings_urls_are_used(db, tenant, fakes, settings,
                                                        django_capture_on_commit_callbacks):
    settings.INFERENCE_URLS = [fakes[0].url + "/"]
    version = make_version(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        assert staging.version_stage_enqueue(version=version) == [fakes[0].url]
    version.refresh_from_db()
    assert version.staging[fakes[0].url]["status"] == "staged"


def test_transient_failures_retry_with_exponential_backoff(tenant, rows, fakes, monkeypatch,
                                                           django_capture_on_commit_callbacks):
    waits = []
    real = staging.backoff_seconds
    monkeypatch.setattr(staging, "backoff_seconds", lambda n: waits.append(real(n)) or real(n))
    w = fakes[0]
    w.script["/v1/load_lora_adapter"].extend([
        (503, error("model loading")),
        (500, error("boom")),
        (400, error("fetching http://portal/... answered HTTP 502", code="adapter_fetch_failed")),
    ])
    version = make_version(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        staging.version_stage_enqueue(version=version, worker_urls=[w.url])
    version.refresh_from_db()
    assert len(w.calls("/v1/load_lora_adapter")) == 4
    assert waits == [2.0, 4.0, 8.0]
    assert version.staging[w.url]["status"] == "staged" and version.staging[w.url]["attempts"] == 4


def test_backoff_doubles_from_the_setting_and_is_capped(settings):
    settings.ADAPTER_STAGE_RETRY_SECONDS = 0.5
    assert [staging.backoff_seconds(n) for n in range(5)] == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert staging.backoff_seconds(20) == staging.MAX_BACKOFF_SECONDS


def test_an_unreachable_worker_fails_after_the_last_retry(tenant, db, django_capture_on_commit_callbacks):
    dead = "http://127.0.0.1:9"
    InferenceWorker.objects.create(url=dead)
    version = make_version(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        staging.version_stage_enqueue(version=version)
    version.refresh_from_db()
    entry = version.staging[dead]
    assert entry["status"] == "failed" and entry["attempts"] == staging.STAGE_MAX_RETRIES + 1
    assert "ConnectError" in entry["error"]


def test_a_rejected_adapter_fails_at_once_with_the_workers_reason(tenant, rows, fakes,
                                                                  django_capture_on_commit_callbacks):
    for w, code in zip(fakes, ["adapter_invalid", "adapter_checksum_mismatch"], strict=True):
        w.script["/v1/load_lora_adapter"].append((400, error(f"adapter 'x': {code} here", code=code)))
    version = make_version(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        staging.version_stage_enqueue(version=version)
    version.refresh_from_db()
    for w, code in zip(fakes, ["adapter_invalid", "adapter_checksum_mismatch"], strict=True):
        assert len(w.requests) == 1
        entry = version.staging[w.url]
        assert entry["status"] == "failed" and entry["attempts"] == 1
        assert entry["error"] == f"HTTP 400: adapter 'x': {code} here"


def test_a_version_retired_while_loading_is_unloaded_again(tenant, rows, fakes, monkeypatch):
    version = make_version(tenant)
    real = staging.stage_on_worker

    def retire_meanwhile(*, version, worker_url):
        result = real(version=version, worker_url=worker_url)
        AdapterVersion.objects.filter(pk=version.pk).update(status=AdapterVersion.Status.RETIRED)
        return result

    monkeypatch.setattr(staging, "stage_on_worker", retire_meanwhile)
    assert tasks.version_stage_task.apply(args=(version.pk, fakes[0].url)).get() == "skipped"
    assert [p for p, _, _ in fakes[0].requests] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
    assert not fakes[0].loaded


@pytest.mark.django_db(transaction=True)
def test_concurrent_worker_updates_merge_into_one_status_map(tenant):
    version = make_version(tenant)
    urls = [f"http://w{i}:8001" for i in range(8)]
    barrier = threading.Barrier(len(urls))

    def record(url):
        try:
            barrier.wait()
            staging._record(version.pk, url, status="staged", attempts=1, error="")
        finally:
            connection.close()

    threads = [threading.Thread(target=record, args=(url,)) for url in urls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    version.refresh_from_db()
    assert sorted(version.staging) == urls and all(e["status"] == "staged" for e in version.staging.values())


# --- unstaging -----------------------------------------------------------------------------------


def test_unstage_unloads_everywhere_and_ignores_404(tenant, rows, fakes, django_capture_on_commit_callbacks):
    version = make_version(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        staging.version_stage_enqueue(version=version, worker_urls=[fakes[0].url])
    assert staging.version_unstage(version=version) == {fakes[0].url: "unloaded", fakes[1].url: "absent"}
    for w in fakes:
        assert w.calls("/v1/unload_lora_adapter") == [{"lora_name": version.worker_name}]
        assert w.requests[-1][2] == f"Bearer {TOKEN}"


def test_retire_unloads_through_the_lifecycle_service(tenant, rows, fakes, django_capture_on_commit_callbacks):
    version = make_version(tenant)
    with django_capture_on_commit_callbacks(execute=True):
        staging.version_stage_enqueue(version=version)
    assert all(version.worker_name in w.loaded for w in fakes)
    with django_capture_on_commit_callbacks(execute=True):
        adapter_version_retire(version=version, actor=None)
    assert not any(version.worker_name in w.loaded for w in fakes)


def test_unstage_retries_an_unreachable_worker_in_the_background(tenant, db, monkeypatch):
    InferenceWorker.objects.create(url="http://127.0.0.1:9")
    monkeypatch.setattr(staging, "backoff_seconds", lambda n: 0)
    version = make_version(tenant)
    results = staging.version_unstage(version=version)
    assert "ConnectError" in results["http://127.0.0.1:9"]


# --- the internal download endpoint ------------------------------------------------------------


AUTH = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}


def _url(version, filename="adapter_model.safetensors"):
    return f"/internal/adapters/{version.uid}/{filename}"


def test_internal_download_streams_the_stored_file(client, tenant):
    version = make_version(tenant)
    for filename, data in (("adapter_config.json", CONFIG), ("adapter_model.safetensors", WEIGHTS)):
        response = client.get(_url(version, filename), **AUTH)
        assert response.status_code == 200 and response.streaming
        assert b"".join(response.streaming_content) == data
        assert response["Content-Length"] == str(len(data))
        assert response["X-Content-SHA256"] == version.file_sha256[filename]


def test_internal_download_streams_an_async_iterator_under_asgi(tenant):
    from asgiref.sync import async_to_sync
    from django.test import AsyncRequestFactory

    from portal.adapters.internal_views import adapter_file

    version = make_version(tenant)
    request = AsyncRequestFactory().get(_url(version), headers={"authorization": f"Bearer {TOKEN}"})
    response = adapter_file(request, uid=version.uid, filename="adapter_model.safetensors")
    assert response.status_code == 200 and response.is_async  # Django would buffer a sync iterator whole
    assert response["Content-Length"] == str(len(WEIGHTS))

    async def body() -> bytes:
        return b"".join([chunk async for chunk in response.streaming_content])

    assert async_to_sync(body)() == WEIGHTS


@pytest.mark.parametrize("header", [None, "Bearer wrong", TOKEN, "Basic " + TOKEN])
def test_internal_download_needs_the_fleet_token(client, tenant, header):
    version = make_version(tenant)
    extra = {"HTTP_AUTHORIZATION": header} if header else {}
    assert client.get(_url(version), **extra).status_code == 401


def test_without_a_token_nobody_downloads(client, tenant, settings):
    settings.INFERENCE_ADMIN_TOKEN = None
    version = make_version(tenant)
    for remote_addr in ("127.0.0.1", "::1", "10.0.0.5"):
        response = client.get(_url(version), REMOTE_ADDR=remote_addr)
        assert response.status_code == 503 and "INFERENCE_ADMIN_TOKEN" in response.json()["error"]


def test_internal_download_404s(client, tenant):
    ready = make_version(tenant)
    assert client.get(_url(ready, "adapter_model.bin"), **AUTH).status_code == 404
    assert client.get(_url(ready, "..%2Fadapter_config.json"), **AUTH).status_code == 404
    assert client.get(f"/internal/adapters/{ready.uid.hex[:8]}/adapter_config.json", **AUTH).status_code == 404
    assert client.get("/internal/adapters/00000000-0000-0000-0000-000000000000/adapter_config.json",
                      **AUTH).status_code == 404
    for number, status in enumerate(["uploaded", "validating", "rejected", "retired"], start=2):
        version = make_version(tenant, number=number, status=status)
        assert client.get(_url(version), **AUTH).status_code == 404, status
    staff = make_version(tenant, number=9, stored=False, source_path="/somewhere")
    assert client.get(_url(staff), **AUTH).status_code == 404
    with_files_gone = make_version(tenant, number=10)
    default_storage.delete(f"{with_files_gone.storage_dir}/adapter_model.safetensors")
    assert client.get(_url(with_files_gone), **AUTH).status_code == 404

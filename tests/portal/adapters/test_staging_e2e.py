"""End to end, all real: a tenant uploads a PEFT directory -> the validate task (eager) accepts it
against the shapes the fleet poll read from a real tiny inference worker -> staging asks that
worker to load it by URL -> the worker downloads both files from the portal's internal endpoint
(live server, Bearer token) and checks their sha256 -> the worker lists the adapter and serves
it exactly as it serves the same directory loaded by path."""

from __future__ import annotations

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from portal.adapters.models import AdapterVersion
from portal.adapters.services import adapter_create, adapter_version_retire, adapter_version_upload
from portal.fleet.models import InferenceWorker
from portal.fleet.services import worker_poll
from protocol.adapter_format import BaseShapes
from tests.portal.adapters.peft_files import peft_config, write_peft

TOKEN = "e2e-fleet-secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TARGETS = ("q_proj", "v_proj", "down_proj")

pytestmark = pytest.mark.real_staging


@pytest.fixture(autouse=True)
def tiny_base():
    """Overrides the conftest's fixed shapes: validation reads the polled worker's."""
    return None


@pytest.fixture(scope="module")
def worker(tmp_path_factory, live_server):
    """The tiny worker, fetching adapters only from the live portal's origin."""
    from tests.inference.server.server_process import start_server
    from tests.inference.server.tiny_lora import write_base

    root = tmp_path_factory.mktemp("e2e")
    base = write_base(root / "base")
    proc = start_server(
        ["--model", str(base), "--served-model-name", "tiny-base", "--dtype", "float32", "--kv-cache-memory", "4MiB",
         "--max-num-seqs", "4", "--max-lora-rank", "16"],
        root / "worker.log",
        env={"INFERENCE_ADMIN_TOKEN": TOKEN, "INFERENCE_ADAPTER_CACHE_DIR": str(root / "cache"),
             "INFERENCE_PORTAL_ORIGINS": live_server.url},
    )
    yield proc
    proc.stop()


def _complete(url: str, model: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": "t5 t17 t42 t99 t3 t250", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.django_db(transaction=True)
def test_upload_validate_stage_and_serve(worker, live_server, settings, tenant, member, tmp_path):
    settings.INFERENCE_ADMIN_TOKEN = TOKEN
    settings.PORTAL_INTERNAL_URL = live_server.url
    settings.INFERENCE_URLS = []
    row = worker_poll(worker=InferenceWorker.objects.create(url=worker.url, name="tiny"))
    assert row.healthy, row.last_error
    shapes = BaseShapes.from_config(row.base_config)
    directory = write_peft(tmp_path / "upload", shapes, rank=8, targets=TARGETS, seed=3,
                           config=peft_config(r=8, lora_alpha=16, target_modules=list(TARGETS),
                                              base_model_name_or_path=shapes.name))

    adapter = adapter_create(tenant=tenant, name="pirate", actor=member)
    files = [SimpleUploadedFile(p.name, p.read_bytes()) for p in sorted(directory.iterdir())]
    version = adapter_version_upload(adapter=adapter, files=files, actor=member)  # validate + stage on commit
    version.refresh_from_db()
    assert version.status == AdapterVersion.Status.READY, version.rejection_reasons
    entry = version.staging[worker.url]
    assert entry["status"] == "staged" and entry["attempts"] == 1, entry

    listed = httpx.get(f"{worker.url}/v1/adapters", headers=AUTH).json()["data"]
    mine = next(a for a in listed if a["name"] == version.worker_name)
    assert mine["tier"] in ("host", "device") and mine["path"].endswith(version.worker_name)

    r = httpx.post(f"{worker.url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "by-path", "lora_path": str(directory)})
    assert r.status_code == 200, r.text
    served = _complete(worker.url, version.worker_name)
    assert served == _complete(worker.url, "by-path") and served != _complete(worker.url, "tiny-base")

    # without the token the portal refuses the worker's download
    url = f"{live_server.url}/internal/adapters/{version.uid}/adapter_model.safetensors"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers=AUTH).content == (directory / "adapter_model.safetensors").read_bytes()

    # retired: unloaded from the worker, never downloadable again
    adapter_version_retire(version=version, actor=member)
    names = [a["name"] for a in httpx.get(f"{worker.url}/v1/adapters", headers=AUTH).json()["data"]]
    assert version.worker_name not in names
    assert httpx.get(url, headers=AUTH).status_code == 404

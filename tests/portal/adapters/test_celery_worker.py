"""One upload validated by a real `celery worker` process over Redis (eager everywhere else).

The worker reads the test database (committed rows: transactional_db) and the test's storage
root, and consumes a queue of its own (every task routed there, not to the `adapters` queue the
settings route validation to) so that other suites sharing the Redis database are not disturbed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from django.db import connection

from portal.adapters.models import AdapterVersion
from portal.adapters.services import adapter_create, adapter_version_upload
from portal.adapters.validation import SMOLLM2_135M
from tests.portal.adapters.conftest import upload
from tests.portal.adapters.peft_files import write_peft, zip_dir

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.skipif(not os.environ.get("REDIS_URL"), reason="needs Redis as the Celery broker")
def test_a_real_worker_validates_an_upload(transactional_db, tenant, member, storage_root, tmp_path, monkeypatch):
    from portal.celery import app

    monkeypatch.setattr("portal.adapters.selectors.base_shapes_current", lambda: SMOLLM2_135M)
    queue = f"adapters-test-{uuid.uuid4().hex[:8]}"
    previous = {name: app.conf[name] for name in ("task_always_eager", "task_default_queue", "task_routes")}
    # conf.update (not assignment) tells the router its routes changed.
    app.conf.update(task_always_eager=False, task_default_queue=queue, task_routes={"*": {"queue": queue}})
    db = connection.settings_dict
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
        "STORAGE_ROOT": str(storage_root),
        "INFERENCE_URLS": "http://127.0.0.1:9",  # nothing listens: staging (if present) fails fast
    }
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal.celery:app", "worker", "--pool=solo", "-Q", queue,
             "-l", "info", "--without-heartbeat", "--without-gossip", "--without-mingle"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        adapter = adapter_create(tenant=tenant, name="bot", actor=member)
        files = [upload("bot.zip", zip_dir(write_peft(tmp_path / "bot", SMOLLM2_135M, rank=2)))]
        version = adapter_version_upload(adapter=adapter, files=files, actor=member)  # on_commit: .delay
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            version.refresh_from_db()
            if version.status in ("ready", "rejected"):
                break
            time.sleep(0.3)
    finally:
        app.conf.update(previous)
        proc.terminate()
        proc.wait(15)
    text = log.read_text()
    assert version.status == "ready", (version.status, version.rejection_reasons, text[-3000:])
    assert "adapter_version_validate_task" in text
    assert sorted(p.name for p in (storage_root / version.storage_dir).iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors",
    ]  # fmt: skip
    assert AdapterVersion.objects.get(pk=version.pk).file_sha256

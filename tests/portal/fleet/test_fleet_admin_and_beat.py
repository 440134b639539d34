"""Staff see and manage workers in the admin; the periodic poll is on `celery beat`'s schedule."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portal.fleet.models import InferenceWorker

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.django_db
def test_the_worker_list_shows_health_load_and_resident_adapters(admin_client):
    InferenceWorker.objects.create(
        url="http://gpu-0:8001", name="gpu-0", healthy=True, num_running=3, num_waiting=2, kv_cache_usage=0.42,
        resident_adapters={"lora-<b>": "device", "lora-a": "host", "lora-c": "disk"}, base_model="smollm2",
    )
    InferenceWorker.objects.create(url="http://gpu-1:8001", last_error="not ready: GET /ready: cannot connect")

    page = admin_client.get("/admin/fleet/inferenceworker/").content.decode()

    assert "gpu-0" in page and "http://gpu-1:8001" in page
    assert "5 (3 + 2)" in page and "42%" in page
    assert "lora-&lt;b&gt; (device), lora-a (host)" in page and "lora-c" not in page
    assert "cannot connect" in page


@pytest.mark.django_db
def test_staff_add_a_worker_by_url_and_a_trailing_slash_is_dropped(admin_client):
    response = admin_client.post("/admin/fleet/inferenceworker/add/",
                                 {"url": "http://inference-2:8001/", "name": "cpu box", "enabled": "on"})

    assert response.status_code == 302
    worker = InferenceWorker.objects.get()
    assert (worker.url, worker.name, worker.enabled, worker.healthy) == ("http://inference-2:8001", "cpu box", True, False)

    response = admin_client.post("/admin/fleet/inferenceworker/add/", {"url": "ftp://nope", "name": ""})
    assert response.status_code == 200 and "not an http(s) URL" in response.content.decode()


@pytest.mark.django_db
def test_admin_actions_poll_and_disable(admin_client, fake_worker, dead_url):
    good = InferenceWorker.objects.create(url=fake_worker.url)
    bad = InferenceWorker.objects.create(url=dead_url)
    changelist = "/admin/fleet/inferenceworker/"

    response = admin_client.post(changelist, {"action": "poll_now", "_selected_action": [good.pk, bad.pk]},
                                 follow=True)

    assert "Polled 2 worker(s): 1 healthy." in response.content.decode()
    good.refresh_from_db()
    bad.refresh_from_db()
    assert good.healthy and not bad.healthy

    admin_client.post(changelist, {"action": "disable", "_selected_action": [good.pk]})
    good.refresh_from_db()
    assert not good.enabled


def test_the_poll_task_is_on_the_beat_schedule_every_10_seconds():
    from portal.celery import app

    entry = app.conf.beat_schedule["fleet-poll"]
    assert entry["task"] == "portal.fleet.tasks.fleet_poll_task"
    assert entry["schedule"] == 10.0
    assert "portal.fleet.tasks.fleet_poll_task" in app.tasks


def test_celery_beat_itself_schedules_the_poll(tmp_path):
    """The real `celery beat` process (Django set up by Celery's fixup) lists the entry."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}  # memory broker: nothing is sent anywhere
    log = tmp_path / "beat.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "portal.celery:app", "beat", "-l", "debug",
             "-s", str(tmp_path / "schedule"), "--pidfile", ""],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "Current schedule" not in log.read_text() and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(10)
    text = log.read_text()
    assert "Current schedule" in text, text
    assert "<ScheduleEntry: fleet-poll portal.fleet.tasks.fleet_poll_task()" in text, text

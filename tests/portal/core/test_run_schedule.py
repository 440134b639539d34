"""manage.py run_schedule: the beat schedule run in-process for installs without a broker
(make run with REDIS_URL unset), here against a fake inference worker on loopback."""

import logging
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command

from portal.celery import app
from portal.core.management.commands.run_schedule import Schedule
from portal.fleet.models import InferenceWorker
from tests.portal.fleet.conftest import fake_worker, make_fake_worker  # noqa: F401 -- fixtures

pytestmark = pytest.mark.django_db(transaction=True)  # the command closes stale connections, as a worker does
LOGGER = "portal.core.management.commands.run_schedule"


@pytest.fixture
def worker_settings(fake_worker, settings):  # noqa: F811
    settings.INFERENCE_URLS = [fake_worker.url]
    settings.INFERENCE_ADMIN_TOKEN = None
    return fake_worker


def polls(worker) -> int:
    return sum(path == "/ready" for path, _ in worker.requests)


def test_entries_run_when_due_with_beats_timing(worker_settings, caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    schedule = Schedule(app)
    assert {e.name for e in schedule.entries} >= {"fleet-poll", "usage-rollup-hourly", "adapters-prewarm"}

    wait = schedule.tick()  # at start nothing is due: the workers started alongside are still loading
    assert polls(worker_settings) == 0 and not InferenceWorker.objects.exists()
    assert 0 < wait <= 10

    fleet = next(e for e in schedule.entries if e.name == "fleet-poll")
    fleet.last_run_at -= timedelta(seconds=11)
    schedule.tick()

    [worker] = InferenceWorker.objects.all()  # the poll registered and polled the worker
    assert worker.healthy and worker.url == worker_settings.url and polls(worker_settings) == 1
    ran = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert any("fleet-poll done" in m for m in ran)
    assert not any("usage-rollup-hourly" in m or "adapters-prewarm" in m for m in ran)  # not due yet
    schedule.tick()
    assert polls(worker_settings) == 1  # not due again for another 10 s


def test_a_failing_task_is_logged_and_the_others_still_run(worker_settings, monkeypatch, caplog):
    def broken():
        raise RuntimeError("database on fire")

    monkeypatch.setitem(app.conf.beat_schedule, "ghost", {"task": "portal.nowhere.ghost_task", "schedule": 5.0})
    monkeypatch.setattr(app.tasks["portal.adapters.prewarm.prewarm_task"], "run", broken)

    Schedule(app).run_all()

    errors = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert any("adapters-prewarm failed" in m and "database on fire" in m for m in errors), errors
    assert any("ghost: no task named portal.nowhere.ghost_task" in m for m in errors), errors
    assert InferenceWorker.objects.get().healthy  # the fleet poll ran all the same


def test_the_command_once_runs_every_entry_and_says_what_it_schedules(worker_settings):
    out = StringIO()
    call_command("run_schedule", "--once", stdout=out)
    assert "fleet-poll (portal.fleet.tasks.fleet_poll_task)" in out.getvalue()
    assert InferenceWorker.objects.get().healthy


def test_a_fresh_process_finds_every_scheduled_task(tmp_path):
    """In its own process nothing has imported the apps' tasks modules yet (the usage roll-up and
    spool replay were 'no task named ...' under make run)."""
    from tests.portal.embedded_sqlite import run_on_embedded_sqlite

    result = run_on_embedded_sqlite(
        "from portal.celery import app\n"
        "from portal.core.management.commands.run_schedule import Schedule\n"
        "schedule = Schedule(app)\n"
        "print(sorted(e.name for e in schedule.entries if e.task not in app.tasks))", tmp_path / "db.sqlite3")

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"

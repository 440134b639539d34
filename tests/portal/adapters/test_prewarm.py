"""Predictive prewarm from the usage ledger: the adapters busy in the coming hour on the last 7
days (plus the last hour) are staged on the healthy workers that do not hold them yet, over real
HTTP to loopback stand-in workers; top-N and the workers' host-tier size bound it."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from portal.adapters import prewarm, tasks
from portal.adapters.models import AdapterVersion
from portal.adapters.services import adapter_version_retire
from portal.fleet.models import InferenceWorker
from portal.usage.models import UsageRecord
from tests.portal.adapters.test_staging import make_version
from tests.portal.adapters.test_staging_fakes import FakeWorker

pytestmark = [pytest.mark.django_db, pytest.mark.real_staging]

NOW = datetime(2026, 11, 30, 10, 0, tzinfo=UTC)
_ids = itertools.count()


def used(version, at: datetime, n: int = 1) -> None:
    for _ in range(n):
        UsageRecord.objects.create(request_id=f"r{next(_ids)}", tenant=version.adapter.tenant,
                                   model=version.adapter.public_id, adapter_version=version, created_at=at)


@pytest.fixture
def history(tenant):
    """busy: every day at 10:15 (the coming hour) -> 7; now: twice in the last hour -> 2;
    evening: only at 15:00 and at 11:00 sharp -> 0; one request of busy today at 10:05 doesn't count yet."""
    busy = make_version(tenant, name="busy", stored=False, source_path="/a/busy")
    now = make_version(tenant, name="now", stored=False, source_path="/a/now")
    evening = make_version(tenant, name="evening", stored=False, source_path="/a/evening")
    for day in range(1, 8):
        used(busy, NOW - timedelta(days=day) + timedelta(minutes=15))
        used(evening, NOW - timedelta(days=day) + timedelta(hours=5))
    used(evening, NOW - timedelta(days=1) + timedelta(hours=1))
    used(busy, NOW - timedelta(days=8) + timedelta(minutes=15), n=5)  # older than the 7 days
    used(now, NOW - timedelta(minutes=30), n=2)
    used(busy, NOW + timedelta(minutes=5))  # the future (clock skew) is not history
    return {"busy": busy, "now": now, "evening": evening}


def test_scores_count_the_coming_hour_on_the_last_7_days_and_the_last_hour(history):
    scores = prewarm.prewarm_scores(now=NOW)
    assert scores == {history["busy"].adapter_id: 7, history["now"].adapter_id: 2}


@pytest.fixture
def fakes():
    workers = [FakeWorker(), FakeWorker(), FakeWorker()]
    yield workers
    for w in workers:
        w.close()


def test_prewarm_stages_where_not_resident(history, fakes, django_capture_on_commit_callbacks):
    busy, now = history["busy"], history["now"]
    InferenceWorker.objects.create(url=fakes[0].url, healthy=True, resident_adapters={busy.worker_name: "host"})
    InferenceWorker.objects.create(url=fakes[1].url, healthy=True, resident_adapters={busy.worker_name: "disk"})
    InferenceWorker.objects.create(url=fakes[2].url, healthy=False)  # not polled healthy: skipped
    with django_capture_on_commit_callbacks(execute=True):
        plan = prewarm.prewarm(now=NOW)
    assert plan.staged == {fakes[0].url: [now.worker_name], fakes[1].url: [busy.worker_name, now.worker_name]}
    assert [b["lora_name"] for b in fakes[0].calls("/v1/load_lora_adapter")] == [now.worker_name]
    assert sorted(b["lora_name"] for b in fakes[1].calls("/v1/load_lora_adapter")) == sorted(
        [busy.worker_name, now.worker_name])
    assert not fakes[2].requests
    busy.refresh_from_db()
    assert busy.staging[fakes[1].url]["status"] == "staged" and fakes[0].url not in busy.staging


def test_top_n_and_the_host_tier_size_bound_it(history, fakes, settings, django_capture_on_commit_callbacks):
    busy, now = history["busy"], history["now"]
    InferenceWorker.objects.create(url=fakes[0].url, healthy=True)
    InferenceWorker.objects.create(url=fakes[1].url, healthy=True, base_config={"max_cpu_loras": 1})
    settings.ADAPTER_PREWARM_TOP_N = 1
    with django_capture_on_commit_callbacks(execute=True):
        assert prewarm.prewarm(now=NOW).staged == {fakes[0].url: [busy.worker_name],
                                                   fakes[1].url: [busy.worker_name]}
    with django_capture_on_commit_callbacks(execute=True):
        assert prewarm.prewarm(now=NOW, top_n=5).staged == {
            fakes[0].url: [busy.worker_name, now.worker_name], fakes[1].url: [busy.worker_name]}


def test_the_deployed_version_is_prewarmed_not_a_retired_one(tenant, history, fakes, user,
                                                            django_capture_on_commit_callbacks):
    busy = history["busy"]
    v2 = make_version(tenant, name="busy", number=2, stored=False, source_path="/a/busy2")
    InferenceWorker.objects.create(url=fakes[0].url, healthy=True)
    adapter_version_retire(version=busy, actor=user)
    with django_capture_on_commit_callbacks(execute=True):
        plan = prewarm.prewarm(now=NOW, top_n=1)
    assert plan.staged == {fakes[0].url: [v2.worker_name]}
    assert AdapterVersion.objects.get(pk=busy.pk).staging == {}


def test_the_task_counts_and_the_beat_entry_is_hourly(history, fakes, monkeypatch):
    InferenceWorker.objects.create(url=fakes[0].url, healthy=True)
    monkeypatch.setattr(prewarm, "timezone", type("tz", (), {"now": staticmethod(lambda: NOW)}))
    assert tasks.prewarm_task.apply().get() == 2

    class App:
        class conf:  # noqa: N801 -- mimics celery's app.conf
            beat_schedule = {"fleet-poll": {}}

    prewarm.register_beat(App)
    assert set(App.conf.beat_schedule) == {"fleet-poll", "adapters-prewarm"}
    entry = App.conf.beat_schedule["adapters-prewarm"]
    assert entry["task"] == "portal.adapters.prewarm.prewarm_task" and entry["schedule"] == 3600.0


def test_nothing_to_prewarm_without_history(db, fakes):
    InferenceWorker.objects.create(url=fakes[0].url, healthy=True)
    assert prewarm.prewarm(now=NOW).staged == {}
    assert not fakes[0].requests

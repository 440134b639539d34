"""Every poll keeps one WorkerSample per worker (one bulk insert), and a WorkerEvent when a
worker's state changes: against fake workers that answer over real HTTP on loopback."""

import socket

import httpx
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from portal.fleet.models import InferenceWorker, WorkerEvent, WorkerSample
from portal.fleet.services import fleet_poll, fleet_sync_from_discovery, worker_poll

pytestmark = pytest.mark.django_db

FAST = httpx.Timeout(0.5, connect=0.5)


def events(worker=None) -> list[tuple[str, str]]:
    rows = WorkerEvent.objects.order_by("at", "id")
    if worker is not None:
        rows = rows.filter(worker_id=worker.pk)
    return [(e.worker_name, e.kind) for e in rows]


def test_each_poll_inserts_one_sample_per_worker_in_one_statement(make_fake_worker, dead_url, settings):
    settings.INFERENCE_ADMIN_TOKEN = None
    busy, idle = make_fake_worker(running=3, waiting=2, kv=0.5), make_fake_worker(running=0, waiting=0, kv=0.0)
    settings.INFERENCE_URLS = [busy.url, idle.url, dead_url]

    with CaptureQueriesContext(connection) as queries:
        fleet_poll(timeout=FAST)
    fleet_poll(timeout=FAST)

    inserts = [q["sql"] for q in queries.captured_queries if q["sql"].startswith('INSERT INTO "fleet_workersample"')]
    assert len(inserts) == 1
    assert WorkerSample.objects.count() == 6
    by_url = {w.url: w.pk for w in InferenceWorker.objects.all()}
    first = WorkerSample.objects.filter(worker_id=by_url[busy.url]).order_by("at").first()
    assert (first.resolution, first.polls, first.samples, first.healthy, first.state) == ("raw", 1, 1, True, "healthy")
    assert (first.num_running, first.num_waiting, first.kv_cache_usage) == (3, 2, 0.5)
    assert first.num_running_max == 3 and first.kv_cache_usage_max == 0.5
    # The fake lists lora-a on device, lora-b in host memory, lora-c on disk.
    assert (first.adapters_device, first.adapters_host, first.adapters_disk, first.adapters_loading) == (1, 1, 1, 0)
    assert (first.memory_base_weights, first.memory_kv_cache, first.memory_adapter_slots,
            first.memory_host_adapters) == (269_000_000, 67_108_864, 4_194_304, 2_097_152)
    assert (first.loads, first.load_failures, first.misses, first.hits_device, first.hits_host,
            first.evictions_device, first.evictions_host) == (5, 0, 2, 40, 7, 3, 0)
    dead = WorkerSample.objects.filter(worker_id=by_url[dead_url]).first()
    # Nothing is known of a worker that does not answer: no zeros that would pull a mean down.
    assert (dead.healthy, dead.samples, dead.state, dead.num_running, dead.loads) == (False, 0, "unhealthy", None, None)


def test_events_are_written_when_the_state_changes_not_every_poll(make_fake_worker, settings):
    fake = make_fake_worker()
    worker = InferenceWorker.objects.create(url=fake.url, name="gpu-0")

    worker_poll(worker=worker)
    worker_poll(worker=worker)
    assert events() == [("gpu-0", "healthy")]
    assert WorkerEvent.objects.get().detail == "serves smollm2"

    fake.ready = False
    worker_poll(worker=worker)
    worker_poll(worker=worker)
    assert events() == [("gpu-0", "healthy"), ("gpu-0", "unhealthy")]
    assert WorkerEvent.objects.last().detail == "not ready: GET /ready: HTTP 503: loading"

    fake.ready = True
    fake.responses["/ready"] = (503, "application/json", '{"status": "draining"}')
    worker_poll(worker=worker)
    assert events()[-1] == ("gpu-0", "draining")

    del fake.responses["/ready"]
    worker_poll(worker=worker)
    worker_poll(worker=worker)
    assert events() == [("gpu-0", "healthy"), ("gpu-0", "unhealthy"), ("gpu-0", "draining"), ("gpu-0", "healthy")]
    assert WorkerSample.objects.filter(worker_id=worker.pk).count() == 7


def test_a_first_poll_that_fails_is_an_event_too(dead_url):
    worker = InferenceWorker.objects.create(url=dead_url)

    worker_poll(worker=worker, timeout=FAST)
    worker_poll(worker=worker, timeout=FAST)

    assert events() == [(dead_url, "unhealthy")]  # a row without a name is named by its URL
    assert "cannot connect" in WorkerEvent.objects.get().detail


def test_a_base_mismatch_is_its_own_event(make_fake_worker, settings):
    settings.INFERENCE_ADMIN_TOKEN = None
    a, b, odd = make_fake_worker(), make_fake_worker(), make_fake_worker(hidden_size=1024)
    settings.INFERENCE_URLS = [a.url, b.url, odd.url]

    fleet_poll(timeout=FAST)

    odd_row = InferenceWorker.objects.get(url=odd.url)
    assert events(odd_row) == [(odd_row.name, "mismatched")]
    assert WorkerEvent.objects.get(worker_id=odd_row.pk).detail.startswith("base model mismatch: serves 'smollm2'")
    assert WorkerSample.objects.get(worker_id=odd_row.pk).state == "mismatched"


def test_a_disabled_worker_polled_from_the_admin_adds_no_history(fake_worker):
    worker = InferenceWorker.objects.create(url=fake_worker.url, enabled=False)

    worker_poll(worker=worker)

    assert WorkerSample.objects.count() == 0 and WorkerEvent.objects.count() == 0


class Dns:
    def __init__(self, answer) -> None:
        self.answer = answer

    def __call__(self, host, port, type=0, **_):  # noqa: A002 -- getaddrinfo's keyword
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in self.answer]


def test_leaving_and_coming_back_to_the_discovery_answer_are_events(settings):
    settings.INFERENCE_DISCOVERY = ["dns://inference-headless:8001"]
    fleet_sync_from_discovery(resolver=Dns(["10.0.0.1", "10.0.0.2"]))
    assert events() == []  # not polled yet: nothing happened to them

    fleet_sync_from_discovery(resolver=Dns(["10.0.0.1"]))
    fleet_sync_from_discovery(resolver=Dns(["10.0.0.1"]))
    assert events() == [("10.0.0.2:8001", "gone")]
    assert "left the answer of dns://inference-headless:8001" in WorkerEvent.objects.get().detail

    fleet_sync_from_discovery(resolver=Dns(["10.0.0.1", "10.0.0.2"]))
    assert events() == [("10.0.0.2:8001", "gone"), ("10.0.0.2:8001", "back")]


def test_history_outlives_a_deleted_worker_row(fake_worker):
    worker = InferenceWorker.objects.create(url=fake_worker.url, name="pod-7")
    worker_poll(worker=worker)
    pk = worker.pk

    InferenceWorker.objects.filter(pk=pk).delete()

    assert WorkerSample.objects.filter(worker_id=pk).count() == 1
    assert WorkerEvent.objects.get(worker_id=pk).worker_name == "pod-7"


def test_a_gone_worker_polled_from_the_admin_is_not_counted_as_serving(fake_worker):
    from django.utils import timezone

    worker = InferenceWorker.objects.create(url=fake_worker.url, discovered_by="dns://x:8001",
                                            gone_since=timezone.now(), last_polled_at=timezone.now())

    worker_poll(worker=worker)

    sample = WorkerSample.objects.get()
    assert (sample.state, sample.healthy, sample.samples, sample.num_running) == ("gone", False, 0, None)
    assert WorkerEvent.objects.count() == 0  # it was gone and still is

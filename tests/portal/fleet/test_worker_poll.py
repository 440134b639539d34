"""worker_poll / fleet_poll against a real HTTP server on loopback that answers like a worker."""

import time

import httpx
import pytest

from portal.fleet.models import InferenceWorker
from portal.fleet.selectors import route_candidates
from portal.fleet.services import fleet_poll, fleet_sync_from_settings, worker_poll

pytestmark = pytest.mark.django_db

FAST = httpx.Timeout(0.3, connect=0.3)


def row(url: str, **fields) -> InferenceWorker:
    return InferenceWorker.objects.create(url=url, name=fields.pop("name", ""), **fields)


def test_a_healthy_worker_records_load_kv_memory_base_model_and_adapter_tiers(fake_worker, settings):
    settings.INFERENCE_ADMIN_TOKEN = None
    worker = row(fake_worker.url)

    polled = worker_poll(worker=worker)

    stored = InferenceWorker.objects.get(pk=worker.pk)
    for w in (polled, stored):
        assert w.healthy and w.last_error == ""
        assert w.base_model == "smollm2"
        assert (w.num_running, w.num_waiting, w.load) == (2, 1, 3)
        assert w.kv_cache_usage == pytest.approx(0.25)
        assert w.resident_adapters == {"lora-a": "device", "lora-b": "host", "lora-c": "disk"}
        assert w.memory == {"base_weights": 269_000_000, "kv_cache": 67_108_864, "adapter_slots": 4_194_304,
                            "host_adapters": 2_097_152, "process_resident_memory_bytes": 1_500_000_000}
        assert w.cache_stats == {"hits": {"device": 40, "host": 7}, "evictions": {"device": 3, "host": 0},
                                 "misses": 2, "loads": 5, "load_failures": 0,
                                 "prefix_queries": 4000, "prefix_hits": 3000}
        assert w.last_seen_at is not None and w.last_polled_at == w.last_seen_at
    assert stored.has_resident("lora-a") and stored.has_resident("lora-b") and not stored.has_resident("lora-c")
    assert w.base_config["hidden_size"] == 576 and w.base_config["max_lora_rank"] == 16
    assert [path for path, _ in fake_worker.requests] == [
        "/ready", "/v1/models", "/metrics", "/v1/base_model", "/v1/adapters"
    ]


def test_the_admin_token_goes_to_the_adapter_route_only(make_fake_worker, settings):
    settings.INFERENCE_ADMIN_TOKEN = "s3cret"
    fake = make_fake_worker(admin_token="s3cret")

    worker = worker_poll(worker=row(fake.url))

    assert worker.healthy and worker.last_error == ""
    assert dict(fake.requests) == {"/ready": None, "/v1/models": None, "/v1/base_model": None, "/metrics": None,
                                   "/v1/adapters": "Bearer s3cret"}


def test_a_refused_adapter_list_keeps_the_worker_healthy_with_residency_from_metrics(make_fake_worker, settings):
    settings.INFERENCE_ADMIN_TOKEN = "wrong"
    fake = make_fake_worker(admin_token="s3cret")

    worker = worker_poll(worker=row(fake.url))

    assert worker.healthy
    assert worker.resident_adapters == {"lora-a": "device", "lora-b": "host"}
    assert "GET /v1/adapters: HTTP 401" in worker.last_error
    assert "INFERENCE_ADMIN_TOKEN" in worker.last_error


def test_a_bad_cache_counter_is_dropped_without_making_the_worker_unhealthy(fake_worker):
    fake_worker.misses = "NaN"
    worker = worker_poll(worker=row(fake_worker.url))
    assert worker.healthy and worker.last_error == ""
    assert "misses" not in worker.cache_stats and worker.cache_stats["hits"] == {"device": 40, "host": 7}


def test_connection_refused_marks_the_worker_unhealthy(dead_url):
    worker = row(dead_url, healthy=True, num_running=5, resident_adapters={"lora-a": "device"}, base_model="smollm2")

    worker_poll(worker=worker, timeout=FAST)

    worker.refresh_from_db()
    assert not worker.healthy
    assert worker.last_error.startswith("not ready: GET /ready: cannot connect")
    assert (worker.load, worker.resident_adapters, worker.memory, worker.cache_stats) == (0, {}, {}, {})
    assert worker.base_model == "smollm2"  # the last one known is kept
    assert worker.last_polled_at is not None and worker.last_seen_at is None


def test_a_timeout_marks_the_worker_unhealthy_quickly(make_fake_worker):
    fake = make_fake_worker(delay=2.0)
    worker = row(fake.url)

    start = time.monotonic()
    worker_poll(worker=worker, timeout=FAST)

    assert time.monotonic() - start < 1.5
    assert not worker.healthy
    assert worker.last_error == "not ready: GET /ready: timed out (ReadTimeout)"


def test_a_worker_still_loading_its_model_is_not_ready(make_fake_worker):
    fake = make_fake_worker(ready=False)

    worker = worker_poll(worker=row(fake.url))

    assert not worker.healthy
    assert worker.last_error == "not ready: GET /ready: HTTP 503: loading"


def test_a_dead_engine_reports_its_error(make_fake_worker):
    fake = make_fake_worker(responses={"/ready": (503, "application/json",
                                                  '{"status": "dead", "error": "CUDA error: out of memory"}')})

    worker = worker_poll(worker=row(fake.url))

    assert worker.last_error == "not ready: GET /ready: HTTP 503: dead - CUDA error: out of memory"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("<html>502 Bad Gateway</html>", "GET /metrics: not Prometheus text (ValueError: invalid metric name"),
        ("this is { not prometheus", "GET /metrics: not Prometheus text (ValueError: could not convert"),
        ("# TYPE up gauge\nup 1\n", "GET /metrics: missing vllm:num_requests_running, vllm:num_requests_waiting, "
                                    "vllm:kv_cache_usage_perc"),
        ("vllm:num_requests_running -1\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n",
         "GET /metrics: vllm:num_requests_running has a bad value [-1"),
    ],
)
def test_garbage_metrics_mark_the_worker_unhealthy(make_fake_worker, body, error):
    fake = make_fake_worker(responses={"/metrics": (200, "text/plain", body)})

    worker = worker_poll(worker=row(fake.url))

    assert not worker.healthy
    assert worker.last_error.startswith(error), worker.last_error


@pytest.mark.parametrize(
    ("path", "response", "error"),
    [
        ("/v1/models", (200, "application/json", "[1, 2]"), "GET /v1/models: expected a JSON object, got list"),
        ("/v1/models", (200, "text/html", "<p>hi</p>"), "GET /v1/models: not JSON: '<p>hi</p>'"),
        ("/v1/models", (200, "application/json", '{"data": []}'), "GET /v1/models: no base model listed"),
        ("/v1/models", (500, "application/json", '{"error": {"message": "internal error"}}'),
         "GET /v1/models: HTTP 500: internal error"),
        ("/metrics", (404, "text/plain", "Not Found"), "GET /metrics: HTTP 404: Not Found"),
    ],
)
def test_bad_answers_on_other_routes_say_which_route(make_fake_worker, path, response, error):
    fake = make_fake_worker(responses={path: response})

    worker = worker_poll(worker=row(fake.url))

    assert not worker.healthy
    assert worker.last_error == error


def test_recovery_clears_the_error(make_fake_worker):
    fake = make_fake_worker(ready=False)
    worker = row(fake.url)
    worker_poll(worker=worker)
    assert not worker.healthy

    fake.ready = True
    worker_poll(worker=worker)

    assert worker.healthy and worker.last_error == ""
    assert InferenceWorker.objects.get(pk=worker.pk).healthy


def test_a_poll_does_not_overwrite_what_staff_changed_meanwhile(fake_worker):
    worker = row(fake_worker.url, name="gpu-0")
    InferenceWorker.objects.filter(pk=worker.pk).update(name="renamed", enabled=False)

    worker_poll(worker=worker)

    stored = InferenceWorker.objects.get(pk=worker.pk)
    assert (stored.name, stored.enabled, stored.healthy) == ("renamed", False, True)


def test_fleet_poll_syncs_settings_and_polls_enabled_workers_in_parallel(make_fake_worker, dead_url, settings):
    good = make_fake_worker(running=0, waiting=0)
    slow = [make_fake_worker(delay=4.0) for _ in range(3)]
    disabled = make_fake_worker()
    settings.INFERENCE_URLS = [good.url, slow[0].url + "/", slow[1].url, dead_url]
    row(slow[2].url)  # added in the admin
    row(disabled.url, enabled=False)

    start = time.monotonic()
    workers = fleet_poll(timeout=httpx.Timeout(1.0, connect=1.0))
    elapsed = time.monotonic() - start

    # Three 1 s timeouts in parallel, not one after the other (which takes 3 s at least); the
    # margin is for a loaded machine.
    assert elapsed < 2.5
    by_url = {w.url: w for w in workers}
    assert set(by_url) == {good.url, dead_url, *(s.url for s in slow)}
    assert by_url[good.url].healthy
    assert all(not by_url[s.url].healthy and "timed out" in by_url[s.url].last_error for s in slow)
    assert not by_url[dead_url].healthy and "cannot connect" in by_url[dead_url].last_error
    assert disabled.requests == []
    assert [t.url for t in route_candidates(lora_name="lora-a")] == [good.url]


def test_fleet_sync_from_settings_is_idempotent_and_leaves_admin_rows_alone(settings):
    settings.INFERENCE_URLS = ["http://w0:8001/", "http://w1:8001"]
    row("http://admin-added:9000", enabled=False)
    InferenceWorker.objects.create(url="http://w1:8001", name="gpu-1", enabled=False)

    first = fleet_sync_from_settings()
    second = fleet_sync_from_settings()

    assert [w.url for w in first] == [w.url for w in second] == ["http://w0:8001", "http://w1:8001"]
    assert InferenceWorker.objects.count() == 3
    w0, w1 = first
    assert (w0.name, w0.enabled, w0.healthy) == ("w0:8001", True, False)
    assert (w1.name, w1.enabled) == ("gpu-1", False)


def test_fleet_poll_task_runs_the_poll(fake_worker, settings):
    from portal.fleet.tasks import fleet_poll_task

    settings.INFERENCE_URLS = [fake_worker.url]

    assert fleet_poll_task.apply().get() == 1
    assert InferenceWorker.objects.get(url=fake_worker.url).healthy

"""The dashboards over time: latency (warm vs cold), errors, objectives and the fleet's history,
JSON and pages, over real ledger rows (portal.usage.services.usage_record_create) and real polls
of a worker (portal.fleet.services.fleet_poll against the fake worker of tests/portal/fleet)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.adapters.models import Adapter, AdapterVersion
from portal.fleet.models import InferenceWorker
from portal.fleet.services import fleet_poll
from portal.tenants.services import tenant_create
from portal.usage.rollups import usage_rollup_refresh
from portal.usage.services import usage_record_create
from tests.portal.fleet.conftest import make_fake_worker  # noqa: F401 -- a fixture used below

W1, W2 = "http://w1:8001", "http://w2:8001"


@pytest.fixture
def staff_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_user(username="root", password="x", is_staff=True))
    return client


@pytest.fixture
def traffic(db):
    """Five minutes ago: acme's adapter served 3 warm requests and 1 cold one (its adapter read
    from disk) on w1, globex's base model 1 request on w2 after a retry; 4 errors."""
    when = timezone.now() - timedelta(minutes=5)
    acme = tenant_create(slug="acme", name="Acme", plan="team")  # TTFT p95 target 1000 ms
    globex = tenant_create(slug="globex", name="Globex", plan="enterprise")  # 500 ms
    bot = Adapter.objects.create(tenant=acme, name="bot")
    v1 = AdapterVersion.objects.create(adapter=bot, number=1, source_path="/nowhere")
    n = iter(range(1000))

    def record(tenant, model, **fields):
        values = {"prompt_tokens": 10, "completion_tokens": 20, "latency_ms": 500.0, **fields}
        usage_record_create(request_id=f"req_{next(n)}", tenant=tenant, model=model, created_at=when,
                            finished_at=when, **values)

    for _ in range(3):
        record(acme, "acme/bot", adapter_version=v1, worker_url=W1, adapter_tier="device",
               time_to_first_token_ms=100.0, inter_token_ms=10.0, queue_ms=5.0)
    record(acme, "acme/bot", adapter_version=v1, worker_url=W1, adapter_tier="disk", time_to_first_token_ms=2500.0,
           inter_token_ms=12.0, queue_ms=400.0, latency_ms=3000.0)
    record(globex, "smollm2", worker_url=W2, time_to_first_token_ms=50.0, inter_token_ms=8.0, queue_ms=1.0,
           latency_ms=200.0, upstream_attempts=2)
    for _ in range(2):
        record(acme, "acme/bot", status_code=429, error="rate limit", error_code="rate_limit_exceeded",
               completion_tokens=0)
    record(acme, "acme/bot", status_code=503, error="no worker", error_code="no_healthy_worker", upstream_attempts=2,
           completion_tokens=0)
    record(globex, "smollm2", status_code=429, error="budget", error_code="budget_exceeded", completion_tokens=0)
    return {"acme": acme, "globex": globex, "version": v1}


def _busy(data: dict) -> list[dict]:
    return [bucket for bucket in data["buckets"] if bucket["requests"]]


@pytest.mark.parametrize("rolled_up", [False, True], ids=["ledger", "rollups"])
def test_latency_json_splits_warm_and_cold_and_filters(staff_client, traffic, rolled_up):
    if rolled_up:  # the minute roll-ups hold those rows: the same numbers come from them
        usage_rollup_refresh()
    data = staff_client.get("/dashboards/api/latency.json", {"range": "15m", "bucket": "1m"}).json()
    assert data["source"] == ("rollup:minute" if rolled_up else "ledger")
    assert data["range"]["range"] == "15m" and data["bucket"] == "1m" and len(data["buckets"]) in (15, 16)
    (bucket,) = _busy(data)
    assert (bucket["requests"], bucket["completed"], bucket["cold_requests"]) == (9, 5, 1)
    assert data["requests"] == 9 and data["cold_requests"] == 1

    bot = staff_client.get("/dashboards/api/latency.json", {"range": "15m", "bucket": "1m", "model": "acme/bot"}).json()
    (bucket,) = _busy(bot)
    assert bucket["completed"] == 4 and bucket["cold_requests"] == 1
    # The cold-start cost: the warm requests' TTFT against the one whose adapter came from disk.
    assert bucket["ttft_warm_ms"]["p50"] == 100 and bucket["ttft_cold_ms"]["p50"] == 2500
    assert bucket["ttft_ms"]["p95"] == pytest.approx(100 + 0.85 * 2400)
    assert bucket["itl_ms"]["p50"] == 10 and bucket["queue_ms"]["p99"] == pytest.approx(5 + 0.97 * 395)
    assert bucket["latency_ms"]["p50"] == 500

    version = traffic["version"].pk
    two = staff_client.get("/dashboards/api/latency.json", {"range": "1h", "tenant": "acme", "version": version,
                                                            "worker": W1}).json()
    assert two["source"] == "ledger" and two["filters"] == {"tenant": "acme", "model": None, "version": str(version),
                                                           "worker": W1}
    assert sum(b["completed"] for b in two["buckets"]) == 4
    w2 = staff_client.get("/dashboards/api/latency.json", {"range": "1h", "worker": W2}).json()
    assert sum(b["completed"] for b in w2["buckets"]) == 1 and w2["cold_requests"] == 0


@pytest.mark.parametrize(("params", "names"), [({"tenant": "nobody"}, "tenant:"), ({"version": "v1"}, "version:")])
def test_latency_filters_the_reads_refuse_are_400s(staff_client, traffic, params, names):
    response = staff_client.get("/dashboards/api/latency.json", params)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(names)
    page = staff_client.get("/dashboards/latency/", params)
    assert page.status_code == 400 and names in page.content.decode()


def test_the_latency_page_has_its_pickers_five_charts_and_a_table(staff_client, traffic):
    html = staff_client.get("/dashboards/latency/", {"range": "1h", "model": "acme/bot"}).content.decode()
    for name in ("tenant", "model", "version", "worker"):
        assert f'<select name="{name}">' in html, name
    assert '<option value="acme/bot" selected>' in html and f'<option value="{W2}">' in html
    assert f'<option value="{traffic["version"].pk}">acme/bot@v1</option>' in html
    for chart in ("latency-ttft", "latency-cold", "latency-itl", "latency-e2e", "latency-queue"):
        assert f'data-chart="{chart}" data-src="/dashboards/api/latency.json?range=1h&amp;model=acme%2Fbot"' in html
    # One table row for the one busy minute: 7 requests of acme/bot (4 completed), 1 cold; TTFT p50 100.
    row = html.split('<table class="dash-table" id="latency-table">')[1].split("<tbody>")[1].split("</tr>")[0]
    cells = [cell.split("</td>")[0] for cell in row.split('<td class="num">')[1:]]
    assert cells[:4] == ["7", "4", "1", "100"], cells
    assert 'data-field="cold_requests">1<' in html


def test_errors_json_by_status_and_code_with_retries_and_per_tenant(staff_client, traffic):
    data = staff_client.get("/dashboards/api/errors.json", {"range": "15m", "bucket": "5m"}).json()
    assert data["range"]["bucket"] == "5m" and len(data["buckets"]) == len(data["retries"]) == len(data["requests"])
    totals = {(s["status"], s["code"]): sum(s["counts"]) for s in data["series"]}
    assert totals == {(429, "rate_limit_exceeded"): 2, (503, "no_healthy_worker"): 1, (429, "budget_exceeded"): 1}
    assert all(len(s["counts"]) == len(data["buckets"]) for s in data["series"])
    assert sum(data["retries"]) == 2 and sum(data["requests"]) == 9
    acme, globex = data["by_tenant"]
    assert (acme["slug"], acme["requests"], acme["errors"]) == ("acme", 7, 3)
    assert acme["by_code"] == {"429 rate_limit_exceeded": 2, "503 no_healthy_worker": 1}
    assert (globex["slug"], globex["requests"], globex["errors"]) == ("globex", 2, 1)

    only = staff_client.get("/dashboards/api/errors.json", {"range": "15m", "tenant": "globex"}).json()
    assert only["tenant"] == "globex" and [(s["status"], s["code"]) for s in only["series"]] == [(429, "budget_exceeded")]
    assert [t["slug"] for t in only["by_tenant"]] == ["globex"] and sum(only["retries"]) == 1
    html = staff_client.get("/dashboards/errors/", {"range": "15m"}).content.decode()
    assert "429 rate_limit_exceeded: 2 · 503 no_healthy_worker: 1" in html
    assert 'data-chart="errors" data-src="/dashboards/api/errors.json?range=15m"' in html
    assert staff_client.get("/dashboards/api/errors.json", {"tenant": "nobody"}).status_code == 400


def test_objectives_put_the_tenants_missing_their_target_now_first(staff_client, traffic):
    data = staff_client.get("/dashboards/api/objectives.json", {"range": "1h"}).json()
    assert data["window_minutes"] == 15
    acme, globex = data["tenants"]
    # acme (team: p95 under 1000 ms): 3 of its 4 completed requests met it; its p95 is 2140 now.
    assert (acme["slug"], acme["target_ms"], acme["target_source"], acme["completed"], acme["met"]) == (
        "acme", 1000, "plan", 4, 3)
    assert acme["share"] == 0.75 and acme["p95_now_ms"] == pytest.approx(2140) and acme["missing_now"] is True
    assert (globex["slug"], globex["target_ms"], globex["share"], globex["missing_now"]) == ("globex", 500, 1.0, False)
    html = staff_client.get("/dashboards/objectives/", {"range": "1h"}).content.decode()
    first_row = html.split('<table class="dash-table" id="objectives">')[1].split("<tbody>")[1].split("</tr>")[0]
    assert '<tr class="missing"><td>acme</td>' in first_row and ">missing<" in first_row
    assert "75%" in first_row

    globex_tenant = traffic["globex"]
    globex_tenant.ttft_p95_target_ms = 40
    globex_tenant.save(update_fields=["ttft_p95_target_ms"])
    data = staff_client.get("/dashboards/api/objectives.json", {"range": "1h"}).json()
    assert [(t["slug"], t["target_source"], t["missing_now"]) for t in data["tenants"]] == [
        ("globex", "tenant", True), ("acme", "plan", True)]


def test_fleet_history_json_and_page_from_real_polls(staff_client, make_fake_worker, settings):  # noqa: F811
    fake = make_fake_worker(running=2, waiting=1)
    settings.INFERENCE_URLS = [fake.url]
    fleet_poll()
    fake.running = 4
    fleet_poll()
    fake.ready = False
    fleet_poll()  # the worker goes unhealthy: a health change
    worker = InferenceWorker.objects.get(url=fake.url)

    data = staff_client.get("/dashboards/api/fleet-history.json", {"range": "15m", "bucket": "1m"}).json()
    # 1-minute buckets are served at the minute resolution (history_resolution: the coarsest rows
    # no wider than the bucket); the polls not folded into minutes yet are read raw at its live edge.
    assert data["range"]["range"] == "15m" and data["resolution"] == "minute"
    assert len(data["buckets"]) in (15, 16) and data["workers"] == [{"id": worker.pk, "name": str(worker)}]
    series = data["series"]
    for values in (series["num_running"], series["num_waiting"], series["kv_cache_usage"],
                   series["adapters"]["device"], series["loads_per_min"]["host"], *series["memory"].values()):
        assert len(values) == len(data["buckets"])
    seen = [v for v in series["num_running"] if v is not None]
    assert seen and seen[-1] in (3, 2, 4)  # the mean of the healthy polls of each minute
    assert [a["kind"] for a in data["annotations"]][-1] == "unhealthy"
    assert all(a["worker"] == str(worker) for a in data["annotations"])

    one = staff_client.get("/dashboards/api/fleet-history.json", {"range": "15m", "worker": worker.pk}).json()
    assert one["annotations"] == data["annotations"]
    other = InferenceWorker.objects.create(url="http://idle:8001")
    idle = staff_client.get("/dashboards/api/fleet-history.json", {"range": "15m", "worker": other.pk}).json()
    assert idle["annotations"] == [] and all(v is None for v in idle["series"]["num_running"])

    html = staff_client.get("/dashboards/", {"range": "15m"}).content.decode()
    for chart in ("history-requests", "history-kv", "history-adapters", "history-swaps", "history-memory"):
        assert f'data-chart="{chart}" data-src="/dashboards/api/fleet-history.json?range=15m"' in html, chart
    events = html.split('id="fleet-events"')[1].split("</table>")[0]
    assert ">unhealthy<" in events and str(worker) in events
    assert f'<option value="{worker.pk}">' in html  # the worker picker
    assert 'id="dash-live" data-refresh-s="10"' in html
    html = staff_client.get("/dashboards/", {"range": "15m", "worker": other.pk}).content.decode()
    assert "No worker changed health in this range" in html and f'<option value="{other.pk}" selected>' in html

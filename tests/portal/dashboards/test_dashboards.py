"""Staff dashboards: who may see them, the snapshot and summary JSON their charts read over
seeded rows, and the pages' time range (every range and bucket; bad ones are 400s naming the
parameter). The series over time (latency, errors, objectives, fleet history) are in
test_series.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.adapters.models import Adapter, AdapterVersion
from portal.fleet.models import InferenceWorker, WorkerDiscovery
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from portal.usage.models import UsageRecord
from portal.usage.rollups import usage_rollup_refresh
from portal.usage.services import usage_record_create

RANGED_PAGES = ["/dashboards/", "/dashboards/tenants/", "/dashboards/latency/", "/dashboards/errors/",
                "/dashboards/objectives/", "/dashboards/adapters/"]
PAGES = [*RANGED_PAGES, "/dashboards/billing/"]
RANGED_APIS = ["/dashboards/api/fleet-history.json", "/dashboards/api/tenants.json", "/dashboards/api/latency.json",
               "/dashboards/api/errors.json", "/dashboards/api/objectives.json", "/dashboards/api/adapters.json"]
APIS = [*RANGED_APIS, "/dashboards/api/fleet.json", "/dashboards/api/billing.json"]
RANGES = ["15m", "1h", "6h", "24h", "7d", "30d"]
BUCKETS = {"1m": 60, "5m": 300, "15m": 900, "1h": 3600, "6h": 21600, "1d": 86400}


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user(username="root", password="x", is_staff=True)


@pytest.fixture
def seeded(db):
    now = timezone.now()
    two_days_ago = now - timedelta(days=2)
    acme = tenant_create(slug="acme", name="<i>Acme</i>", plan="team")
    globex = tenant_create(slug="globex", name="Globex", plan="enterprise")
    bot = Adapter.objects.create(tenant=acme, name="bot")
    v1 = AdapterVersion.objects.create(adapter=bot, number=1, source_path="/nowhere")
    n = iter(range(1000))

    def record(tenant, model, *, when=now, version=None, prompt=10, completion=20, ttft=50.0, latency=200.0,
               status=200, error="", disconnected=False):
        usage_record_create(request_id=f"req_{next(n)}", tenant=tenant, model=model, adapter_version=version,
                            prompt_tokens=prompt, completion_tokens=completion, time_to_first_token_ms=ttft,
                            latency_ms=latency, status_code=status, error=error,
                            client_disconnected=disconnected, created_at=when, finished_at=when)

    record(acme, "acme/bot", version=v1, prompt=10_000_000, completion=10_000_000, ttft=10, latency=100)
    record(acme, "acme/bot", version=v1, prompt=1000, completion=1000, ttft=30, latency=300)
    record(acme, "smollm2", ttft=20, latency=400, when=two_days_ago)
    record(acme, "smollm2", prompt=0, completion=0, status=429, error="rate limit", ttft=None, latency=1)
    record(acme, "smollm2", prompt=5, completion=0, status=503, error="no worker", ttft=None, latency=2)
    record(acme, "smollm2", completion=7, disconnected=True, ttft=999, latency=9999)
    record(globex, "smollm2", prompt=100, completion=100)
    InferenceWorker.objects.create(
        url="http://w1:8001", name="w1", healthy=True, num_running=3, num_waiting=2, kv_cache_usage=0.25,
        resident_adapters={"lora-a": "device", "lora-b": "host", "lora-c": "host", "lora-d": "disk"},
        memory={"base_weights": 269_000_000, "kv_cache": 67_108_864, "adapter_slots": 4_194_304,
                "host_adapters": 2_097_152, "process_resident_memory_bytes": 1_500_000_000},
        cache_stats={"hits": {"device": 90, "host": 10}, "misses": 4, "loads": 4, "load_failures": 1,
                     "evictions": {"device": 6, "host": 1}, "prefix_queries": 4000, "prefix_hits": 3000},
        last_seen_at=now)
    InferenceWorker.objects.create(url="http://w2:8001", healthy=False, last_error="GET /ready: ConnectError")
    return {"acme": acme, "globex": globex, "version": v1}


def test_anonymous_users_go_to_login_and_non_staff_get_404(client, django_user_model, seeded):
    for url in PAGES + APIS:
        response = client.get(url)
        assert response.status_code == 302 and "login" in response["location"], url
    member = django_user_model.objects.create_user(username="ada", password="x")
    membership_create(tenant=seeded["acme"], user=member, role=Membership.Role.OWNER)
    client.force_login(member)
    for url in PAGES + APIS:
        assert client.get(url).status_code == 404, url
    inactive = django_user_model.objects.create_user(username="old", password="x", is_staff=True, is_active=False)
    client.force_login(inactive)
    assert client.get("/dashboards/api/latency.json").status_code in (302, 404)


def test_staff_see_every_page_with_its_chart_and_the_nav(client, staff, seeded):
    client.force_login(staff)
    for url in PAGES:
        response = client.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert "vendor/chartjs/chart.umd.min.js" in html and "dashboards/dashboards.js" in html
        assert "<i>Acme</i>" not in html
        for link in ("/dashboards/errors/", "/dashboards/objectives/", "/dashboards/latency/"):
            assert f'href="{link}"' in html, (url, link)
    html = client.get("/dashboards/tenants/").content.decode()
    assert "&lt;i&gt;Acme&lt;/i&gt;" in html and 'data-chart="tenants"' in html
    assert client.post("/dashboards/").status_code == 405
    assert client.post("/dashboards/api/errors.json").status_code == 405


@pytest.mark.parametrize("name", RANGES)
def test_every_page_and_json_takes_each_range(client, staff, seeded, name):
    client.force_login(staff)
    live = name in ("15m", "1h", "6h")
    for url in RANGED_APIS:
        response = client.get(url, {"range": name})
        assert response.status_code == 200, (url, response.content[:300])
        data = response.json()
        assert data["range"]["range"] == name and data["range"]["live"] is live, url
    for url in RANGED_PAGES:
        response = client.get(url, {"range": name})
        assert response.status_code == 200, url
        html = response.content.decode()
        assert f'<option value="{name}" selected>' in html, url
        # The charts read the JSON of the same range; short ranges ending now refresh themselves.
        assert f"?range={name}" in html, url
        assert ('id="dash-live" data-refresh-s="10"' in html) is live, url


@pytest.mark.parametrize("bucket", BUCKETS)
def test_every_page_and_json_takes_each_bucket(client, staff, seeded, bucket):
    client.force_login(staff)
    for url in RANGED_APIS:
        response = client.get(url, {"range": "6h", "bucket": bucket})
        assert response.status_code == 200, (url, response.content[:300])
        assert response.json()["range"]["bucket_seconds"] == BUCKETS[bucket], url
    for url in RANGED_PAGES:
        html = client.get(url, {"range": "6h", "bucket": bucket}).content.decode()
        assert f'<option value="{bucket}" selected>' in html, url


def test_a_custom_range_is_not_live_and_keeps_its_dates_in_the_form(client, staff, seeded):
    client.force_login(staff)
    end = (timezone.now() + timedelta(minutes=1)).replace(microsecond=0, tzinfo=None)
    start = end - timedelta(days=3)
    params = {"range": "custom", "start": start.isoformat(), "end": end.isoformat()}
    data = client.get("/dashboards/api/tenants.json", params).json()
    assert data["range"]["range"] == "custom" and data["range"]["live"] is False
    assert data["range"]["bucket"] == "1h"  # 72 hourly buckets: the smallest at most 120 points
    assert data["tenants"][0]["requests"] == 6  # the two-day-old request is in
    html = client.get("/dashboards/tenants/", params).content.decode()
    assert f'name="start" value="{start.isoformat()}"' in html and 'id="dash-live"' not in html


BAD_RANGES = [
    ({"range": "2h"}, "range:"),
    ({"range": "6h", "bucket": "7m"}, "bucket:"),
    ({"range": "30d", "bucket": "1m"}, "bucket:"),  # 43,200 points
    ({"range": "custom", "end": "2026-01-02T00:00"}, "start:"),
    ({"range": "custom", "start": "2026-01-02T00:00", "end": "2026-01-01T00:00"}, "end:"),
    ({"range": "custom", "start": "yesterday", "end": "2026-01-01T00:00"}, "start:"),
    ({"range": "custom", "start": "2024-01-01T00:00", "end": "2026-01-01T00:00"}, "start/end:"),
]


@pytest.mark.parametrize(("params", "names"), BAD_RANGES)
def test_bad_ranges_are_400s_naming_the_parameter(client, staff, db, params, names):
    client.force_login(staff)
    for url in RANGED_APIS:
        response = client.get(url, params)
        assert response.status_code == 400, url
        assert response.json()["error"]["message"].startswith(names), (url, response.json())
    for url in RANGED_PAGES:
        response = client.get(url, params)
        assert response.status_code == 400 and names in response.content.decode(), url


@pytest.mark.parametrize(("url", "names"), [
    ("/dashboards/api/billing.json?month=2024-13", "month:"),
    ("/dashboards/api/tenants.json?days=7&range=1w", "range:"),
    ("/dashboards/api/latency.json?tenant=" + "x" * 301, "tenant:"),
    ("/dashboards/api/errors.json?tenant=" + "x" * 301, "tenant:"),
    ("/dashboards/api/fleet-history.json?worker=abc", "worker:"),
    ("/dashboards/api/fleet-history.json?worker=999999", "worker:"),
])
def test_bad_parameters_are_400s(client, staff, url, names, db):
    client.force_login(staff)
    response = client.get(url)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith(names)
    page = client.get("/dashboards/?worker=-1")
    assert page.status_code == 400 and "worker:" in page.content.decode()


def test_fleet_json(client, staff, seeded):
    client.force_login(staff)
    data = client.get("/dashboards/api/fleet.json").json()
    w1, w2 = data["workers"]
    assert (w1["name"], w1["healthy"], w1["num_running"], w1["num_waiting"], w1["queue_depth"]) == ("w1", True, 3, 2, 5)
    assert w1["adapters"] == {"device": 1, "host": 2, "loading": 0, "disk": 1, "failed": 0}
    assert w1["memory"] == {"base_weights": 269_000_000, "kv_cache": 67_108_864, "adapter_slots": 4_194_304,
                            "host_adapters": 2_097_152}
    assert w1["memory_other"] == {"process_resident_memory_bytes": 1_500_000_000}
    assert w2["healthy"] is False and w2["last_error"] == "GET /ready: ConnectError" and w2["name"] == "http://w2:8001"
    assert w2["memory"] == dict.fromkeys(["base_weights", "kv_cache", "adapter_slots", "host_adapters"])
    totals = data["totals"]
    assert (totals["workers"], totals["healthy"], totals["num_running"], totals["num_waiting"]) == (2, 1, 3, 2)
    assert totals["adapters"]["host"] == 2 and totals["memory"]["kv_cache"] == 67_108_864
    # 100 adapter requests: 90 found a slot, 10 host memory, 4 of those waited on a disk load
    assert w1["cache"] == {"requests": 100, "misses": 4, "hits": {"device": 90, "host": 10},
                           "warm_rate": 0.96, "slot_rate": 0.9, "loads": 4, "load_failures": 1,
                           "evictions": {"device": 6, "host": 1}}
    assert w2["cache"] is None
    assert totals["cache"] == w1["cache"]  # the unhealthy worker's (empty) counters add nothing
    assert w1["prefix_cache"] == {"queries": 4000, "hits": 3000, "hit_rate": 0.75} and w2["prefix_cache"] is None
    assert totals["prefix_cache"] == w1["prefix_cache"]
    html = client.get("/dashboards/").content.decode()
    assert "<strong>75%</strong> of 4000 prompt tokens found cached" in html
    assert "prefix cache 75% of 4000 prompt tokens" in html


def test_fleet_cache_totals_add_up_healthy_workers_and_show_on_the_page(client, staff, db):
    for name, stats, healthy in (
        ("a", {"hits": {"device": 30, "host": 10}, "misses": 10, "evictions": {"device": 2}}, True),
        ("b", {"hits": {"device": 50, "host": 10}, "misses": 0, "evictions": {"host": 3}}, True),
        ("c", {"hits": {"device": 1000}, "misses": 0}, False),  # its last counters are stale: left out
        ("d", {}, True),  # no adapter request yet
    ):
        InferenceWorker.objects.create(url=f"http://{name}:8001", name=name, healthy=healthy, cache_stats=stats)
    client.force_login(staff)
    data = client.get("/dashboards/api/fleet.json").json()
    totals = data["totals"]["cache"]
    assert (totals["requests"], totals["misses"], totals["warm_rate"], totals["slot_rate"]) == (100, 10, 0.9, 0.8)
    assert totals["evictions"] == {"device": 2, "host": 3}
    assert [w["cache"] and w["cache"]["warm_rate"] for w in data["workers"]] == [0.75, 1.0, 1.0, None]
    html = client.get("/dashboards/").content.decode()
    assert "<strong>90%</strong> of 100 adapter requests found the adapter in memory" in html
    assert "(80% already in a slot) · 10 loaded from disk" in html
    assert "75% warm" in html and "no adapter requests" in html and 'data-chart="fleet-cache"' in html


def test_the_fleet_page_shows_discovery_gone_and_mismatched_workers_with_their_reasons(client, staff, db):
    now = timezone.now()
    WorkerDiscovery.objects.create(spec="dns://inference-headless:8001", addresses=["http://10.0.0.5:8001"],
                                   last_error="inference-headless does not resolve: Name or service not known",
                                   resolved_at=now, last_ok_at=now - timedelta(minutes=3))
    spec = "dns://inference-headless:8001"
    InferenceWorker.objects.create(url="http://10.0.0.5:8001", healthy=True, discovered_by=spec)
    InferenceWorker.objects.create(url="http://10.0.0.6:8001", discovered_by=spec, gone_since=now,
                                   last_error=f"gone: left the answer of {spec} at ...; not routed")
    InferenceWorker.objects.create(url="http://10.0.0.7:8001", base_model="llama-3-8b",
                                   last_error="base model mismatch: serves 'llama-3-8b', the fleet serves 'smollm2'; "
                                              "not routed")
    client.force_login(staff)

    data = client.get("/dashboards/api/fleet.json").json()
    assert [w["state"] for w in data["workers"]] == ["healthy", "gone", "mismatched"]
    assert data["discovery"][0]["error"].startswith("inference-headless does not resolve")
    html = client.get("/dashboards/").content.decode()
    assert "Discovery:" in html and "does not resolve: Name or service not known" in html
    assert "1 worker; those keep being polled" in html and "found by dns://inference-headless:8001" in html
    assert ">gone<" in html and ">mismatched<" in html
    assert "serves &#x27;llama-3-8b&#x27;, the fleet serves &#x27;smollm2&#x27;" in html


def test_tenants_json_counts_errors_quota_rejections_and_spend(client, staff, seeded):
    client.force_login(staff)
    data = client.get("/dashboards/api/tenants.json?range=7d").json()
    acme, globex = data["tenants"]
    assert acme["slug"] == "acme" and globex["slug"] == "globex"
    assert (acme["requests"], acme["errors"], acme["quota_rejections"], acme["disconnects"]) == (6, 2, 1, 1)
    assert (acme["prompt_tokens"], acme["completion_tokens"]) == (10_001_025, 10_001_027)
    # team plan: 0.08 / 0.24 USD per 1M tokens: 0.80008200 + 2.40024648
    assert acme["spend"] == "3.20" and globex["spend"] == "0.00"
    assert globex["total_tokens"] == 200
    # the last 24 hours: the two-day-old request drops out
    assert client.get("/dashboards/api/tenants.json?range=24h").json()["tenants"][0]["requests"] == 5
    assert (data["range"]["range"], data["range"]["bucket"]) == ("7d", "1h")  # what the charts read


def test_top_adapters_and_billing_json(client, staff, seeded):
    client.force_login(staff)
    top = client.get("/dashboards/api/adapters.json?range=15m").json()
    assert top["adapters"] == [{"model": "acme/bot", "tenant": "acme", "requests": 2, "errors": 0,
                                "prompt_tokens": 10_001_000, "completion_tokens": 10_001_000, "total_tokens": 20_002_000,
                                "versions": 1}]
    month = timezone.now().strftime("%Y-%m")
    billing = client.get(f"/dashboards/api/billing.json?month={month}").json()
    assert billing["month"] == month and [t["slug"] for t in billing["tenants"]] == ["acme", "globex"]
    assert billing["total_tokens"] == sum(t["total_tokens"] for t in billing["tenants"])
    assert billing["total_cost"] == "3.20" and billing["tenants"][0]["slug"] == "acme"
    assert client.get("/dashboards/api/billing.json?month=1999-01").json() == {
        "month": "1999-01", "tenants": [], "total_tokens": 0, "total_cost": "0.00"}
    # Billing stays per month: it has no range form.
    assert 'name="range"' not in client.get("/dashboards/billing/").content.decode()


def test_top_adapters_come_from_the_roll_ups_and_the_live_tail(client, staff, seeded):
    """Rolled-up requests count even once their ledger rows are gone (the page reads roll-ups),
    requests since the last roll-up run count from the ledger, and an adapter called by its
    `@vN` id and by its deployment id is one adapter with every version it ran on."""
    acme, v1 = seeded["acme"], seeded["version"]
    v2 = AdapterVersion.objects.create(adapter=v1.adapter, number=2, source_path="/nowhere")
    other = AdapterVersion.objects.create(adapter=Adapter.objects.create(tenant=seeded["globex"], name="sql"),
                                          number=1, source_path="/nowhere")
    three_days_ago = timezone.now() - timedelta(days=3)
    usage_record_create(request_id="req_v2_old", tenant=acme, model="acme/bot@v2", adapter_version=v2,
                        prompt_tokens=5, completion_tokens=5, status_code=502, error="upstream",
                        created_at=three_days_ago, finished_at=three_days_ago)
    usage_record_create(request_id="req_sql_old", tenant=seeded["globex"], model="globex/sql", adapter_version=other,
                        prompt_tokens=1, completion_tokens=2, created_at=three_days_ago, finished_at=three_days_ago)
    usage_rollup_refresh()
    # Roll-ups only from here on for what they hold: a ledger row they folded no longer matters.
    UsageRecord.objects.filter(created_at__lt=timezone.now() - timedelta(days=1)).delete()
    usage_record_create(request_id="req_tail", tenant=acme, model="acme/bot@v1", adapter_version=v1,
                        prompt_tokens=100, completion_tokens=100, created_at=timezone.now(),
                        finished_at=timezone.now())
    client.force_login(staff)
    top = client.get("/dashboards/api/adapters.json?range=7d").json()
    assert top["adapters"] == [
        {"model": "acme/bot", "tenant": "acme", "requests": 4, "errors": 1, "prompt_tokens": 10_001_105,
         "completion_tokens": 10_001_105, "total_tokens": 20_002_210, "versions": 2},
        {"model": "globex/sql", "tenant": "globex", "requests": 1, "errors": 0, "prompt_tokens": 1,
         "completion_tokens": 2, "total_tokens": 3, "versions": 1}]
    assert top["range"]["range"] == "7d"
    # The last day holds neither old request; base-model requests are no adapter's.
    day = client.get("/dashboards/api/adapters.json?range=24h").json()["adapters"]
    assert [(a["model"], a["requests"], a["versions"]) for a in day] == [("acme/bot", 3, 1)]
    html = client.get("/dashboards/adapters/?range=7d").content.decode()
    assert "<td>globex/sql</td>" in html and "smollm2" not in html


def test_empty_states(client, staff, db):
    client.force_login(staff)
    assert "No inference worker is registered yet" in client.get("/dashboards/").content.decode()
    assert "No requests in this range" in client.get("/dashboards/tenants/").content.decode()
    assert "Nothing billed" in client.get("/dashboards/billing/").content.decode()
    assert "No completed requests in this range" in client.get("/dashboards/latency/").content.decode()
    assert "No errors in this range" in client.get("/dashboards/errors/").content.decode()
    assert "No completed requests in this range" in client.get("/dashboards/objectives/").content.decode()
    assert "No adapter was used in this range" in client.get("/dashboards/adapters/").content.decode()

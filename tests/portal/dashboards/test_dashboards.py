"""Staff dashboards: who may see them, and the JSON their charts read, over seeded rows."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.adapters.models import Adapter, AdapterVersion
from portal.fleet.models import InferenceWorker, WorkerDiscovery
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from portal.usage.services import usage_record_create

PAGES = ["/dashboards/", "/dashboards/tenants/", "/dashboards/latency/", "/dashboards/adapters/",
         "/dashboards/billing/"]
APIS = ["/dashboards/api/fleet.json", "/dashboards/api/tenants.json", "/dashboards/api/latency.json",
        "/dashboards/api/adapters.json", "/dashboards/api/billing.json"]


@pytest.fixture
def staff(django_user_model):
    return django_user_model.objects.create_user(username="root", password="x", is_staff=True)


@pytest.fixture
def seeded(db):
    now = timezone.now()
    yesterday = now - timedelta(days=1)
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
    record(acme, "smollm2", ttft=20, latency=400, when=yesterday)
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


def test_staff_see_every_page_with_its_chart(client, staff, seeded):
    client.force_login(staff)
    for url in PAGES:
        response = client.get(url)
        assert response.status_code == 200, url
        html = response.content.decode()
        assert "vendor/chartjs/chart.umd.min.js" in html and "dashboards/dashboards.js" in html
        assert "<i>Acme</i>" not in html
    html = client.get("/dashboards/tenants/").content.decode()
    assert "&lt;i&gt;Acme&lt;/i&gt;" in html and 'data-chart="tenants"' in html
    assert client.post("/dashboards/").status_code == 405


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
    data = client.get("/dashboards/api/tenants.json?days=7").json()
    acme, globex = data["tenants"]
    assert acme["slug"] == "acme" and globex["slug"] == "globex"
    assert (acme["requests"], acme["errors"], acme["quota_rejections"], acme["disconnects"]) == (6, 2, 1, 1)
    assert (acme["prompt_tokens"], acme["completion_tokens"]) == (10_001_025, 10_001_027)
    # team plan: 0.08 / 0.24 USD per 1M tokens: 0.80008200 + 2.40024648
    assert acme["spend"] == "3.20" and globex["spend"] == "0.00"
    assert globex["total_tokens"] == 200
    # one day only: yesterday's request drops out
    assert client.get("/dashboards/api/tenants.json?days=1").json()["tenants"][0]["requests"] == 5


def test_latency_json_per_day_tenant_and_model(client, staff, seeded):
    client.force_login(staff)
    data = client.get("/dashboards/api/latency.json?days=3").json()
    assert [d["date"] for d in data["days"]] == [
        (timezone.now() - timedelta(days=k)).date().isoformat() for k in (2, 1, 0)]
    empty, yesterday, today = data["days"]
    assert empty == {"date": empty["date"], "requests": 0, "ttft_ms": {"p50": None, "p95": None, "p99": None},
                     "latency_ms": {"p50": None, "p95": None, "p99": None}}
    assert data["requests"] == 4
    assert yesterday["requests"] == 1 and yesterday["latency_ms"]["p50"] == 400
    # completed only: errors, 429s and the disconnect are left out
    assert today["requests"] == 3 and today["ttft_ms"]["p50"] == 30 and today["latency_ms"]["p50"] == 200
    bot = client.get("/dashboards/api/latency.json?days=3&tenant=acme&model=acme/bot").json()
    assert bot["tenant"] == "acme" and bot["model"] == "acme/bot"
    assert bot["days"][2]["requests"] == 2 and bot["days"][2]["ttft_ms"]["p50"] == 20
    assert bot["days"][2]["latency_ms"]["p99"] == pytest.approx(298)
    assert client.get("/dashboards/api/latency.json?tenant=globex").json()["days"][-1]["requests"] == 1


def test_top_adapters_and_billing_json(client, staff, seeded):
    client.force_login(staff)
    top = client.get("/dashboards/api/adapters.json").json()
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


@pytest.mark.parametrize("url", ["/dashboards/api/tenants.json?days=0", "/dashboards/api/latency.json?days=abc",
                                 "/dashboards/api/billing.json?month=2024-13", "/dashboards/api/adapters.json?days=9999"])
def test_bad_parameters_are_400s(client, staff, url, db):
    client.force_login(staff)
    response = client.get(url)
    assert response.status_code == 400 and "error" in response.json()
    assert client.get("/dashboards/tenants/?days=-1").status_code == 400


def test_empty_states(client, staff, db):
    client.force_login(staff)
    assert "No inference worker is registered yet" in client.get("/dashboards/").content.decode()
    assert "No requests from" in client.get("/dashboards/tenants/").content.decode()
    assert "Nothing billed" in client.get("/dashboards/billing/").content.decode()
    assert "No completed requests in this period" in client.get("/dashboards/latency/").content.decode()

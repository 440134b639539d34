"""The gateway's metrics as Prometheus scrapes them (GET /metrics on the live gateway, open in
development): a request moves its counters and histograms once, under its tenant, model and
status; refusals, quota rejections and skipped workers are counted with bounded labels; nothing a
caller typed becomes a label; the ledger's writes are counted, spooled and replayed ones too, and
production serves all this only to the bearer of METRICS_TOKEN."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import redis

from portal.fleet.selectors import routing_key
from tests.portal.gateway.conftest import (
    BASE,
    chat_prefix_key,
    dead_worker_url,
    make_caller,
    wait_for_row,
    wait_until,
)
from tests.portal.gateway.metrics_scrape import scrape
from tests.tcp_proxy import TcpProxy

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
METRICS_TOKEN = "gateway-metrics-token-" + "9fQ2" * 6


def unique_caller():
    """A tenant of this test's own: its series start at zero whatever ran before."""
    return make_caller(f"metrics-{uuid.uuid4().hex[:10]}")


def post(live, key: str | None, body: dict) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def test_completions_are_counted_under_their_tenant_model_and_status(live):
    caller = unique_caller()
    tenant, labels = caller.tenant.slug, {"tenant": caller.tenant.slug, "model": BASE}
    before = scrape(live.url)

    assert post(live, caller.key, CHAT).status_code == 200
    body = {**CHAT, "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {caller.key}"}) as response:
        request_id = response.headers["x-request-id"]
        arrival = [time.monotonic() for line in response.iter_lines() if line.startswith("data:")]
    wait_for_row(request_id)
    after = wait_until(lambda: (s := scrape(live.url))("loraplex_ledger_writes_total", outcome="written")
                       >= before("loraplex_ledger_writes_total", outcome="written") + 2 and s)

    assert after("loraplex_gateway_requests_total", **labels, status="200") == 2
    assert after("loraplex_gateway_request_duration_seconds_count", **labels) == 2
    assert after("loraplex_gateway_time_to_first_token_seconds_count", **labels) == 2
    assert not after.series("loraplex_gateway_errors_total", tenant=tenant)
    # The stream's duration runs to its last byte: past its first token by the time the tokens took.
    streamed = arrival[-1] - arrival[0]
    assert streamed > 0
    duration = after("loraplex_gateway_request_duration_seconds_sum", **labels)
    first_token = after("loraplex_gateway_time_to_first_token_seconds_sum", **labels)
    assert duration - first_token >= 0.8 * streamed
    assert after("loraplex_gateway_time_to_first_token_seconds_bucket", **labels, le="+Inf") == 2


def test_refusals_are_counted_and_nothing_the_caller_typed_becomes_a_label(live):
    caller = unique_caller()
    tenant = caller.tenant.slug
    bogus = f"bogus{uuid.uuid4().hex}"
    before = scrape(live.url)

    assert post(live, None, CHAT).status_code == 401
    assert post(live, f"sk-{bogus}", CHAT).status_code == 401
    assert post(live, caller.key, {**CHAT, "model": f"{tenant}/{bogus}"}).status_code == 404
    assert post(live, caller.key, {**CHAT, "model": bogus}).status_code == 404
    assert post(live, caller.key, {**CHAT, "messages": bogus}).status_code == 400
    assert httpx.get(f"{live.url}/v1/models", headers={"authorization": f"Bearer {caller.key}"}).status_code == 200
    assert httpx.get(f"{live.url}/v1/{bogus}", headers={"authorization": f"Bearer {caller.key}"}).status_code == 404
    after = scrape(live.url)

    def grew(name: str, **labels: str) -> float:
        return after(name, **labels) - before(name, **labels)

    # Before authentication there is no tenant and no model.
    assert grew("loraplex_gateway_requests_total", tenant="", model="", status="401") == 2
    assert grew("loraplex_gateway_errors_total", tenant="", model="", code="invalid_api_key") == 2
    # A model the gateway could not resolve is "unknown", whatever was asked for.
    assert after("loraplex_gateway_requests_total", tenant=tenant, model="unknown", status="404") == 2
    assert after("loraplex_gateway_errors_total", tenant=tenant, model="unknown", code="model_not_found") == 2
    # A validation error has no code: its type stands in.
    assert after("loraplex_gateway_errors_total", tenant=tenant, model="unknown", code="invalid_request_error") == 1
    # Requests that name no model: the model list, an unknown URL.
    assert after("loraplex_gateway_requests_total", tenant=tenant, model="", status="200") == 1
    assert grew("loraplex_gateway_errors_total", tenant="", model="", code="unknown_url") == 1  # never authenticated
    assert after("loraplex_gateway_time_to_first_token_seconds_count", tenant=tenant, model="") == 0
    assert bogus not in after.text


def test_a_quota_rejection_is_counted_with_the_limit_that_refused(live):
    from portal.quotas.services import quota_set

    caller = unique_caller()
    quota_set(tenant=caller.tenant, requests_per_minute=1)
    labels = {"tenant": caller.tenant.slug, "model": BASE}

    assert [post(live, caller.key, CHAT).status_code for _ in range(2)] == [200, 429]
    after = scrape(live.url)

    assert after("loraplex_gateway_quota_rejections_total", tenant=caller.tenant.slug,
                 limit="requests_per_minute") == 1
    assert after("loraplex_gateway_requests_total", **labels, status="429") == 1
    assert after("loraplex_gateway_errors_total", **labels, code="rate_limit_exceeded") == 1
    assert after("loraplex_gateway_time_to_first_token_seconds_count", **labels) == 1  # the 200 only


def test_a_dead_worker_passed_over_is_an_upstream_retry(live, worker, settings):
    caller = unique_caller()
    key = routing_key(None, chat_prefix_key(caller.tenant, CHAT["messages"]))
    dead = dead_worker_url(key, worker.url, above=True)
    settings.INFERENCE_URLS = [dead, worker.url]
    before = scrape(live.url)

    assert post(live, caller.key, CHAT).status_code == 200
    settings.INFERENCE_URLS = [dead]  # nowhere else to go: a 503, and no retry to count
    assert post(live, caller.key, CHAT).status_code == 503
    after = scrape(live.url)

    assert after("loraplex_gateway_upstream_retries_total", worker=dead, reason="unreachable") == 1
    assert after("loraplex_gateway_upstream_retries_total", worker=worker.url, reason="unreachable") == \
        before("loraplex_gateway_upstream_retries_total", worker=worker.url, reason="unreachable")
    assert after("loraplex_gateway_requests_total", tenant=caller.tenant.slug, model=BASE, status="503") == 1
    assert after("loraplex_gateway_errors_total", tenant=caller.tenant.slug, model=BASE,
                 code="no_worker_available") == 1


def test_production_metrics_need_the_token_and_count_spooled_and_replayed_rows(start_production_web, settings):
    """The deployed web process: /metrics only with METRICS_TOKEN (Prometheus scrapes a pod by its
    IP over plain HTTP); a ledger row spooled while PostgreSQL is gone is counted, the scrape
    still answers then, and the replay (a Celery task elsewhere) shows in the web's totals."""
    from portal.usage.spool import usage_spool_replay

    database = settings.DATABASES["default"]
    prefix = f"test:metrics:{uuid.uuid4().hex}:"
    caller = unique_caller()
    with TcpProxy("127.0.0.5", upstream=(database["HOST"] or "127.0.0.1", int(database["PORT"] or 5432))) as proxy:
        url = f"postgres://{database['USER']}@{proxy.host}:{proxy.port}/{database['NAME']}"
        web = start_production_web(DATABASE_URL=url, DATABASE_POOL_TIMEOUT="1", REDIS_KEY_PREFIX=prefix,
                                   METRICS_TOKEN=METRICS_TOKEN)
        pod = {"host": "10.42.0.7:8000"}  # not in ALLOWED_HOSTS, no X-Forwarded-Proto: as Prometheus scrapes
        for headers in ({}, {"authorization": "Bearer not-the-token"}):
            refused = httpx.get(f"{web.url}/metrics", headers={**pod, **headers}, timeout=30)
            assert refused.status_code == 401 and "loraplex" not in refused.text
        authorized = {**pod, "authorization": f"Bearer {METRICS_TOKEN}"}
        before = scrape(web.url, **authorized)
        assert before.has("loraplex_fleet_workers", state="healthy")
        assert before.has("loraplex_ledger_writes_total", outcome="replayed")
        assert before("loraplex_ledger_writes_total", outcome="replayed") == 0

        body = {**CHAT, "max_tokens": 32, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{web.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {caller.key}"}) as response:
            request_id = response.headers["x-request-id"]
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            proxy.cut()  # PostgreSQL gone for the web process, mid-stream
            assert [line for line in lines if line.startswith("data:")][-1] == "data: [DONE]"

        spooled = wait_until(lambda: (s := scrape(web.url, **authorized))(
            "loraplex_ledger_writes_total", outcome="spooled") == 1 and s, timeout=60)
        assert spooled("loraplex_ledger_writes_total", outcome="written") == 0
        assert "loraplex_fleet_workers" not in spooled.text  # the database is gone: that family alone is
        client = redis.Redis.from_url(settings.REDIS_URL)
        [line] = client.lrange(f"{prefix}usage:spool", 0, -1)
        assert json.loads(line)["request_id"] == request_id

        proxy.restore()
        settings.USAGE_SPOOL_KEY = f"{prefix}usage:spool"
        assert usage_spool_replay() == {"written": 1, "dead": 0, "left": 0}
        replayed = scrape(web.url, **authorized)
        assert replayed("loraplex_ledger_writes_total", outcome="replayed") == 1
        assert replayed("loraplex_ledger_writes_total", outcome="dead") == 0
        assert replayed("loraplex_gateway_requests_total", tenant=caller.tenant.slug, model=BASE, status="200") == 1
        client.delete(*(f"{prefix}usage:spool{suffix}" for suffix in ("", ":replays", ":lock", ":dead")))
        client.close()

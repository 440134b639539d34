"""GET /metrics ahead of Django (portal.core.metrics_asgi): who may read it in each environment,
what the rest of the site still gets, METRICS_TOKEN's checks, and the scrape-time families that
read the database and Redis (fleet workers, Celery queue depth)."""

from __future__ import annotations

import dataclasses
import uuid

import httpx
import pytest
import redis
from django.conf import settings as django_settings
from kombu import Queue
from prometheus_client.parser import text_string_to_metric_families

from portal.config import ConfigError, WebConfig
from portal.core.metrics_asgi import route_metrics
from tests.web_process import PRODUCTION

TOKEN = "metrics-token-" + "Zq7" * 8


async def _site(scope, receive, send):
    """Stands for the portal and the gateway behind /metrics."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"the site"})


async def get(path: str, *, method: str = "GET", headers: dict | None = None) -> httpx.Response:
    transport = httpx.ASGITransport(app=route_metrics(_site))
    async with httpx.AsyncClient(transport=transport, base_url="http://10.1.2.3:8000") as client:
        return await client.request(method, path, headers=headers or {})


def families(response: httpx.Response) -> dict[str, object]:
    return {family.name: family for family in text_string_to_metric_families(response.text)}


@pytest.fixture
def environment(settings):
    def set_to(name: str, token: str | None) -> None:
        settings.CONFIG = dataclasses.replace(settings.CONFIG, environment=name, metrics_token=token)
        settings.METRICS_TOKEN = token

    return set_to


@pytest.mark.django_db(transaction=True)
async def test_development_without_a_token_is_open(environment):
    environment("development", None)

    response = await get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    names = families(response)
    assert {"loraplex_gateway_requests", "loraplex_ledger_writes", "loraplex_fleet_workers"} <= set(names)
    assert (await get("/metrics/")).text == "the site"  # only the exact path
    assert (await get("/")).text == "the site"


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("environment_name", ["development", "production"])
async def test_a_token_is_required_once_set(environment, environment_name):
    environment(environment_name, TOKEN)

    missing = await get("/metrics")
    wrong = await get("/metrics", headers={"authorization": f"Bearer {TOKEN}x"})
    basic = await get("/metrics", headers={"authorization": f"Basic {TOKEN}"})
    right = await get("/metrics", headers={"authorization": f"Bearer {TOKEN}"})

    assert [r.status_code for r in (missing, wrong, basic)] == [401, 401, 401]
    assert missing.headers["www-authenticate"] == 'Bearer realm="metrics"'
    assert "loraplex" not in missing.text + wrong.text + basic.text
    assert right.status_code == 200 and "loraplex_gateway_requests_total" in right.text
    posted = await get("/metrics", method="POST", headers={"authorization": f"Bearer {TOKEN}"})
    assert posted.status_code == 405 and posted.headers["allow"] == "GET"


async def test_production_without_a_token_has_no_metrics(environment):
    environment("production", None)

    for headers in ({}, {"authorization": "Bearer anything"}):
        response = await get("/metrics", headers=headers)
        assert response.status_code == 404 and "loraplex" not in response.text
    assert (await get("/")).text == "the site"


def test_production_refuses_a_short_metrics_token():
    with pytest.raises(ConfigError) as caught:
        WebConfig.from_env({**PRODUCTION, "METRICS_TOKEN": "short"})
    assert caught.value.variable == "METRICS_TOKEN" and "32" in caught.value.message

    assert WebConfig.from_env({**PRODUCTION, "METRICS_TOKEN": TOKEN}).metrics_token == TOKEN
    assert WebConfig.from_env({**PRODUCTION}).metrics_token is None
    assert WebConfig.from_env({"METRICS_TOKEN": "short"}).metrics_token == "short"  # development


def sample(response: httpx.Response, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


@pytest.mark.django_db(transaction=True)
async def test_the_fleet_workers_are_counted_by_state(environment):
    from django.utils import timezone

    from portal.core.db import db_sync_to_async
    from portal.fleet.models import InferenceWorker

    environment("development", None)

    @db_sync_to_async
    def add_workers() -> None:
        InferenceWorker.objects.create(url="http://w1:8001", enabled=True, healthy=True)
        InferenceWorker.objects.create(url="http://w2:8001", enabled=True, healthy=False)
        InferenceWorker.objects.create(url="http://w3:8001", enabled=True, healthy=False)
        InferenceWorker.objects.create(url="http://w4:8001", enabled=False, healthy=True)
        InferenceWorker.objects.create(url="http://w5:8001", enabled=True, healthy=False, gone_since=timezone.now())
        InferenceWorker.objects.create(url="http://w6:8001", enabled=True, healthy=False,
                                       last_error="base model mismatch: serves 'x', the fleet serves 'y'; not routed")

    await add_workers()
    response = await get("/metrics")

    counts = {state: sample(response, "loraplex_fleet_workers", state=state)
              for state in ("healthy", "unhealthy", "mismatched", "gone", "disabled")}
    assert counts == {"healthy": 1, "unhealthy": 2, "mismatched": 1, "gone": 1, "disabled": 1}


@pytest.mark.skipif(not django_settings.REDIS_URL, reason="needs Redis as the Celery broker")
@pytest.mark.django_db(transaction=True)
async def test_queue_depth_is_what_waits_on_the_broker(environment, settings):
    from portal.celery import app

    environment("development", None)
    queue = f"metrics-test-{uuid.uuid4().hex[:8]}"
    settings.CELERY_TASK_QUEUES = (*settings.CELERY_TASK_QUEUES, Queue(queue, routing_key=queue))
    client = redis.Redis.from_url(settings.REDIS_URL)
    try:
        empty = await get("/metrics")
        for _ in range(3):  # published as the beat would, to a queue no worker consumes
            app.send_task("portal.fleet.tasks.fleet_poll_task", queue=queue)
        waiting = await get("/metrics")
    finally:
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        client.close()

    assert sample(empty, "loraplex_celery_queue_depth", queue=queue) == 0
    assert sample(waiting, "loraplex_celery_queue_depth", queue=queue) == 3
    for name in ("celery", "fleet", "adapters"):
        assert sample(waiting, "loraplex_celery_queue_depth", queue=name) is not None


@pytest.mark.django_db(transaction=True)
async def test_no_broker_no_queue_depth_and_a_dead_one_does_not_fail_the_scrape(environment, settings):
    environment("development", None)
    settings.REDIS_URL = None
    assert sample(await get("/metrics"), "loraplex_celery_queue_depth", queue="fleet") is None

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # configured, nothing listening
    response = await get("/metrics")
    assert response.status_code == 200
    assert sample(response, "loraplex_celery_queue_depth", queue="fleet") is None
    assert sample(response, "loraplex_ledger_writes_total", outcome="written") is not None
    assert sample(response, "loraplex_ledger_writes_total", outcome="replayed") is None  # unknown, not 0

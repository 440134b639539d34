"""/healthz against the real database and Redis of the test run."""

import pytest
from django.conf import settings

pytestmark = pytest.mark.django_db


@pytest.fixture
def configured_redis_url() -> str:
    assert settings.REDIS_URL, "run the suite with REDIS_URL set (e.g. redis://127.0.0.1:6379/15)"
    return settings.REDIS_URL


def test_healthy_database_and_redis_give_200(client, configured_redis_url):
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response["Cache-Control"].startswith("max-age=0")
    body = response.json()
    assert body["status"] == "ok"
    database, redis = body["checks"]["database"], body["checks"]["redis"]
    assert database["ok"] is True
    assert database["backend"] == "postgresql"
    assert database["latency_ms"] >= 0
    assert redis == {"ok": True, "configured": True, "latency_ms": redis["latency_ms"]}


def test_unreachable_redis_gives_503_naming_redis(client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1

    response = client.get("/healthz")

    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "degraded"
    assert body["checks"]["database"]["ok"] is True
    assert body["checks"]["redis"]["ok"] is False
    assert body["checks"]["redis"]["configured"] is True
    assert "ConnectionError" in body["checks"]["redis"]["error"]


def test_redis_not_configured_is_reported_and_healthy(client, settings):
    settings.REDIS_URL = None

    response = client.get("/healthz")

    assert response.status_code == 200
    redis = response.json()["checks"]["redis"]
    assert redis["ok"] is True and redis["configured"] is False
    assert "not configured" in redis["detail"]


def test_only_get_is_allowed(client):
    assert client.post("/healthz").status_code == 405

"""/healthz against the real database and Redis of the test run, and the static files' check."""

import json

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


# --- static files ------------------------------------------------------------------------------

MANIFEST_STORAGE = "django.contrib.staticfiles.storage.ManifestStaticFilesStorage"


def use_staticfiles_storage(settings, backend: str, static_root) -> None:
    """As production runs: no finders, the given storage over STATIC_ROOT (re-read on change)."""
    settings.WHITENOISE_USE_FINDERS = False
    settings.STATIC_ROOT = str(static_root)
    settings.STORAGES = {**settings.STORAGES, "staticfiles": {"BACKEND": backend}}


def test_development_serves_static_files_from_their_folders(client):
    static = client.get("/healthz").json()["checks"]["static"]

    assert static["ok"] is True and static["storage"] == "finders"
    assert "served from their source folders" in static["detail"]


def test_a_missing_manifest_gives_503_naming_static(client, settings, tmp_path):
    use_staticfiles_storage(settings, MANIFEST_STORAGE, tmp_path)

    response = client.get("/healthz")

    assert response.status_code == 503
    static = response.json()["checks"]["static"]
    assert static["ok"] is False and static["storage"] == "manifest"
    assert static["error"].startswith("STATIC_ROOT/staticfiles.json is missing or empty: run `manage.py collectstatic")


def test_a_manifest_lacking_a_file_gives_503_naming_the_file(client, settings, tmp_path):
    """A manifest from an older build: the page linking the new file would be a 500."""
    from portal.core.health import _static_source_names

    names = sorted(_static_source_names() - {"css/portal.css"})
    (tmp_path / "staticfiles.json").write_text(json.dumps({"version": "1.1", "hash": "0", "paths": {n: n for n in names}}))
    use_staticfiles_storage(settings, MANIFEST_STORAGE, tmp_path)

    response = client.get("/healthz")

    assert response.status_code == 503
    static = response.json()["checks"]["static"]
    assert static["missing"] == 1
    assert f"1 of {len(names) + 1} static files are missing from STATIC_ROOT/staticfiles.json, e.g. css/portal.css" in static["error"]


def test_without_finders_or_manifest_the_files_must_be_collected(client, settings, tmp_path):
    use_staticfiles_storage(settings, "django.contrib.staticfiles.storage.StaticFilesStorage", tmp_path)

    response = client.get("/healthz")

    assert response.status_code == 503
    assert response.json()["checks"]["static"]["error"].startswith("STATIC_ROOT is missing or empty")

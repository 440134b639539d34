"""The web process as it is deployed: production settings (strong secret, ALLOWED_HOSTS=127.0.0.2,
the fleet token), the PostgreSQL test database, Redis, static files collected into a temporary
STATIC_ROOT, uvicorn on 127.0.0.2 spoken to as the TLS proxy would (X-Forwarded-Proto: https).
Pages and their static assets load; plain HTTP is redirected except the probes and /internal/;
/healthz fails on a missing static manifest; the internal adapter endpoint wants the token from
every client; the API schema wants a user; `manage.py check --deploy` has nothing to say."""

from __future__ import annotations

import hashlib
import re
import secrets
import subprocess
import sys
import uuid

import httpx
import pytest
from django.conf import settings

from tests.web_process import (
    ROOT,
    WebProcess,
    collect_static,
    forwarded_https_client,
    production_env,
    start_web,
    test_database_url,
)

ADMIN_TOKEN = secrets.token_urlsafe(32)
PASSWORD = "a long production password, 7 words"
CONFIG = b'{"peft_type": "LORA", "r": 4}'
WEIGHTS = bytes(range(256)) * 300
ASSET = re.compile(r'(?:src|href)="(/static/[^"]+)"')
HASHED = re.compile(r"\.[0-9a-f]{12}\.(?:css|js)$")  # the manifest storage's names


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, django_db_setup) -> dict:
    """The production environment, its static files collected once for the module."""
    assert settings.REDIS_URL, "run the suite with REDIS_URL set (e.g. redis://127.0.0.1:6379/15)"
    root = tmp_path_factory.mktemp("production")
    env = production_env(database_url=test_database_url(), redis_url=settings.REDIS_URL,
                         static_root=root / "static", storage_root=root / "storage",
                         inference_urls=["http://127.0.0.1:9"], admin_token=ADMIN_TOKEN)
    collect_static(env)
    return env


@pytest.fixture(scope="module")
def web(deployment, tmp_path_factory) -> WebProcess:
    process = start_web(deployment, log_path=tmp_path_factory.mktemp("web") / "web.log")
    yield process
    process.stop()


@pytest.fixture
def proxied(web):
    """A client speaking to the web process as the TLS proxy does."""
    with forwarded_https_client(web, timeout=30) as client:
        yield client


def assert_assets_load(client: httpx.Client, html: str) -> list[str]:
    """Every /static/ URL in the page is a hashed name that answers 200; returns them."""
    assets = ASSET.findall(html)
    assert assets, "the page links no static file"
    for asset in assets:
        assert HASHED.search(asset), f"{asset} is not a manifest (hashed) name"
        assert client.get(asset).status_code == 200, asset
    return assets


def sign_in(client: httpx.Client, web: WebProcess, username: str) -> None:
    """Through the login form, with its CSRF token, as a browser behind the proxy would post it."""
    form = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form.text).group(1)
    https_origin = web.url.replace("http://", "https://", 1)
    response = client.post("/login/", data={"username": username, "password": PASSWORD,
                                            "csrfmiddlewaretoken": token},
                           headers={"referer": f"{https_origin}/login/"})
    assert response.status_code == 302, response.text[:500]
    assert "sessionid" in client.cookies


@pytest.fixture
def staff(transactional_db):
    """A staff user owning tenant acme, committed for the web process to read. Its password is
    hashed with the production hasher (this test process hashes with MD5 for speed)."""
    from django.contrib.auth.hashers import PBKDF2PasswordHasher, make_password
    from django.contrib.auth.models import User

    from portal.tenants.models import Membership
    from portal.tenants.services import membership_create, tenant_create

    user = User.objects.create(username="ops", is_staff=True, password=make_password(PASSWORD, hasher=PBKDF2PasswordHasher()))
    tenant = tenant_create(slug="acme", name="Acme Corp")
    membership_create(tenant=tenant, user=user, role=Membership.Role.OWNER)
    return user


def test_the_login_page_and_its_assets_are_served_with_https_headers(web, proxied):
    response = proxied.get("/login/")

    assert response.status_code == 200
    assert_assets_load(proxied, response.text)
    assert response.headers["strict-transport-security"] == "max-age=31536000; includeSubDomains; preload"
    csrf_cookie = next(c for c in response.headers.get_list("set-cookie") if c.startswith("csrftoken="))
    assert "Secure" in csrf_cookie


def test_a_signed_in_staff_user_gets_the_console_and_the_dashboards(web, proxied, staff):
    sign_in(proxied, web, "ops")

    for page in ("/t/acme/", "/t/acme/usage/", "/dashboards/"):
        response = proxied.get(page)
        assert response.status_code == 200, (page, web.log[-2000:])
        assets = assert_assets_load(proxied, response.text)
        if page == "/dashboards/":
            [chart] = [a for a in assets if "/vendor/chartjs/chart.umd.min." in a]
            script = proxied.get(chart)
            assert script.headers["content-type"].startswith("text/javascript")
            assert b"Chart.js v4" in script.content and b"sourceMappingURL" not in script.content


def test_the_api_schema_and_docs_need_a_signed_in_user(web, proxied, staff):
    for path in ("/api/schema/", "/api/docs/"):
        anonymous = proxied.get(path)
        assert anonymous.status_code == 401, path
        assert anonymous.headers["www-authenticate"] == 'Bearer realm="api"'

    sign_in(proxied, web, "ops")
    schema = proxied.get("/api/schema/", headers={"accept": "application/vnd.oai.openapi+json"})
    assert schema.status_code == 200 and "/api/v1/tenants/{tenant_slug}/adapters/" in schema.json()["paths"]
    assert proxied.get("/api/docs/").status_code == 200


def test_the_api_docs_page_loads_swagger_ui_from_the_collected_static_files(web, proxied, staff):
    sign_in(proxied, web, "ops")
    docs = proxied.get("/api/docs/")

    assert docs.status_code == 200
    # No CDN: every script, stylesheet and icon is one of ours, a hashed name that answers.
    assert not re.search(r'(?:src|href)="(?:https?:)?//', docs.text)
    assets = ASSET.findall(docs.text)
    names = {asset.rsplit("/", 1)[1].split(".")[0] for asset in assets}
    assert {"swagger-ui", "swagger-ui-bundle", "swagger-ui-standalone-preset", "favicon-32x32"} <= names
    for asset in assets:
        assert re.search(r"\.[0-9a-f]{12}\.(?:css|js|png)$", asset), f"{asset} is not a manifest (hashed) name"
        response = proxied.get(asset)
        assert response.status_code == 200 and response.content, asset
        if "/swagger-ui-bundle." in asset:
            assert b"SwaggerUIBundle" in response.content


def test_plain_http_is_redirected_to_https_except_probes_and_internal_downloads(web):
    page = httpx.get(f"{web.url}/login/")
    assert page.status_code == 301
    assert page.headers["location"] == f"{web.url.replace('http://', 'https://', 1)}/login/"

    assert httpx.get(f"{web.url}/healthz").status_code == 200
    internal = httpx.get(f"{web.url}/internal/adapters/{uuid.uuid4()}/adapter_config.json",
                         headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert internal.status_code == 404  # reached (and authorized), not redirected


def test_healthz_reports_the_static_manifest(web):
    body = httpx.get(f"{web.url}/healthz").json()

    assert body["status"] == "ok"
    static = body["checks"]["static"]
    assert static["ok"] is True and static["storage"] == "manifest" and static["files"] > 100


def test_without_the_static_manifest_healthz_is_503_naming_the_static_check(deployment, tmp_path):
    empty = tmp_path / "static"
    empty.mkdir()
    process = start_web({**deployment, "STATIC_ROOT": str(empty)}, log_path=tmp_path / "web.log", healthy=False)
    try:
        response = httpx.get(f"{process.url}/healthz")
        with forwarded_https_client(process) as client:
            page = client.get("/login/")
    finally:
        process.stop()

    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "degraded"
    assert body["checks"]["database"]["ok"] and body["checks"]["redis"]["ok"]
    static = body["checks"]["static"]
    assert static["ok"] is False and static["storage"] == "manifest"
    assert static["error"].startswith("STATIC_ROOT/staticfiles.json is missing or empty")
    assert "collectstatic" in static["error"]
    assert page.status_code == 500  # what the check warns of: no page renders without the manifest


@pytest.fixture
def stored_version(staff, deployment):
    """A ready adapter version whose two files are in the web process's storage."""
    from pathlib import Path

    from portal.adapters.models import Adapter, AdapterVersion, Deployment
    from portal.tenants.models import Tenant

    adapter = Adapter.objects.create(tenant=Tenant.objects.get(slug="acme"), name="bot")
    Deployment.objects.create(adapter=adapter)
    version = AdapterVersion.objects.create(adapter=adapter, number=1, status=AdapterVersion.Status.READY)
    version.storage_dir = f"adapters/{version.uid.hex}"
    version.file_sha256 = {}
    for filename, data in (("adapter_config.json", CONFIG), ("adapter_model.safetensors", WEIGHTS)):
        path = Path(deployment["STORAGE_ROOT"]) / version.storage_dir / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        version.file_sha256[filename] = hashlib.sha256(data).hexdigest()
    version.save()
    return version


def test_internal_downloads_need_the_fleet_token_even_from_loopback(web, stored_version):
    url = f"{web.url}/internal/adapters/{stored_version.uid}/adapter_model.safetensors"

    assert httpx.get(url).status_code == 401  # this client is on loopback, like a same-host proxy
    assert httpx.get(url, headers={"authorization": "Bearer wrong"}).status_code == 401
    allowed = httpx.get(url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert allowed.status_code == 200 and allowed.content == WEIGHTS


def test_a_portal_without_a_token_serves_no_adapter_file_to_anyone(db, settings, tmp_path):
    """Development without INFERENCE_ADMIN_TOKEN: once loopback clients were served; now nobody is."""
    from django.core.files.base import ContentFile
    from django.core.files.storage import default_storage
    from django.test import Client

    from portal.adapters.models import Adapter, AdapterVersion, Deployment
    from portal.tenants.services import tenant_create

    settings.INFERENCE_ADMIN_TOKEN = None
    settings.STORAGES = {**settings.STORAGES, "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(tmp_path)}}}
    adapter = Adapter.objects.create(tenant=tenant_create(slug="acme", name="Acme"), name="bot")
    Deployment.objects.create(adapter=adapter)
    version = AdapterVersion.objects.create(adapter=adapter, number=1, storage_dir="adapters/v1",
                                            file_sha256={"adapter_config.json": hashlib.sha256(CONFIG).hexdigest()})
    default_storage.save("adapters/v1/adapter_config.json", ContentFile(CONFIG))
    url = f"/internal/adapters/{version.uid}/adapter_config.json"

    for remote_addr in ("127.0.0.1", "::1", "10.0.0.5"):
        for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer "}, {"HTTP_AUTHORIZATION": "Bearer guess"}):
            response = Client(REMOTE_ADDR=remote_addr).get(url, **headers)
            assert response.status_code == 503, (remote_addr, headers)
            assert "INFERENCE_ADMIN_TOKEN" in response.json()["error"]


def test_check_deploy_under_production_settings_has_no_warning(tmp_path):
    env = production_env(database_url="postgres://postgres@127.0.0.1:5432/unused", redis_url="redis://127.0.0.1:6379/0",
                         static_root=tmp_path / "static", storage_root=tmp_path / "storage",
                         inference_urls=["http://inference:8001"], admin_token=ADMIN_TOKEN,
                         allowed_hosts=["portal.example.com"], PORTAL_INTERNAL_URL="http://web:8000")

    result = subprocess.run([sys.executable, "manage.py", "check", "--deploy"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)

    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "System check identified no issues (0 silenced).", result.stdout + result.stderr

"""The REST API: access (roles, other tenants, API keys), limits, deployment, retire, delete, schema."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from portal.adapters import limits
from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment
from portal.adapters.selectors import adapter_list_servable, adapter_version_resolve
from portal.adapters.services import adapter_create, adapter_version_upload
from portal.keys.services import api_key_create, api_key_revoke
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create, tenant_suspend
from tests.portal.adapters.conftest import upload
from tests.portal.adapters.peft_files import write_peft, zip_dir

pytestmark = pytest.mark.django_db
BASE = "/api/v1/tenants/acme/adapters/"


def two_files(directory) -> list:
    return [upload(p.name, p.read_bytes()) for p in sorted(directory.iterdir())]


@pytest.fixture
def adapter(tenant, member) -> Adapter:
    return adapter_create(tenant=tenant, name="bot", description="a bot", actor=member)


@pytest.fixture
def ready(adapter, member, tmp_path, django_capture_on_commit_callbacks):
    """Two ready versions of acme/bot."""
    versions = []
    for seed in (1, 2):
        with django_capture_on_commit_callbacks(execute=True):
            v = adapter_version_upload(adapter=adapter, files=two_files(write_peft(tmp_path / f"v{seed}", seed=seed)),
                                       actor=member)
        v.refresh_from_db()
        assert v.status == "ready", v.rejection_reasons
        versions.append(v)
    return versions


def client_for(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def key_client(tenant) -> APIClient:
    _, plaintext = api_key_create(tenant=tenant, name="ci")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    return client


# --- adapters CRUD ---------------------------------------------------------------------------


def test_create_list_retrieve_update_adapters(api, tenant) -> None:
    response = api.post(BASE, {"name": "support-bot", "description": "helps", "base_model": "SmolLM2"}, format="json")
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["public_id"] == "acme/support-bot" and body["latest_ready_version"] is None
    assert body["deployment"]["weights"] == {}
    assert [a["name"] for a in api.get(BASE).json()["results"]] == ["support-bot"]
    assert api.get(f"{BASE}support-bot/").json()["description"] == "helps"
    response = api.patch(f"{BASE}support-bot/", {"description": "helps more"}, format="json")
    assert response.status_code == 200 and response.json()["description"] == "helps more"
    assert api.get(f"{BASE}nope/").status_code == 404
    assert list(AuditEvent.objects.values_list("action", flat=True).order_by("id")) == [
        "adapter.created", "adapter.updated",
    ]  # fmt: skip
    events = api.get("/api/v1/tenants/acme/audit-events/").json()["results"]
    assert [e["action"] for e in events] == ["adapter.updated", "adapter.created"] and events[0]["actor"] == "mia"


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"name": "Bad Name!"}, 400, "name"),
        ({"name": ""}, 400, None),
        ({}, 400, None),
        ({"name": "x" * 65}, 400, None),
        ({"name": ["a"]}, 400, None),
        ({"name": "ok", "description": {"a": 1}}, 400, None),
    ],
)
def test_bad_adapter_bodies_are_400s(api, tenant, body, status, field) -> None:
    response = api.post(BASE, body, format="json")
    assert response.status_code == status and response.json()["detail"], response.json()
    if field:
        assert response.json()["field"] == field


def test_a_duplicate_name_is_a_400(api, adapter) -> None:
    response = api.post(BASE, {"name": "bot"}, format="json")
    assert response.status_code == 400 and "already has an adapter named 'bot'" in response.json()["detail"]


@pytest.mark.parametrize("raw", [b"{", b"[]", b"null", b"\xff\xfe", b'{"name": null}'])
def test_garbage_bodies_never_500(api, adapter, raw) -> None:
    for method, url in (("post", BASE), ("put", f"{BASE}bot/deployment/"), ("patch", f"{BASE}bot/")):
        response = getattr(api, method)(url, raw, content_type="application/json")
        assert 400 <= response.status_code < 500, (method, url, response.content)


# --- limits ----------------------------------------------------------------------------------


def test_the_plans_adapter_limit(api, tenant, member) -> None:
    for i in range(limits.PLAN_LIMITS["free"].max_adapters):
        adapter_create(tenant=tenant, name=f"a{i}", actor=member)
    response = api.post(BASE, {"name": "one-more"}, format="json")
    assert response.status_code == 403 and response.json()["code"] == "limit_exceeded"
    assert "the free plan allows 5 adapters" in response.json()["detail"]


def test_the_plans_storage_limit(api, adapter, tmp_path, monkeypatch, django_capture_on_commit_callbacks) -> None:
    directory = write_peft(tmp_path / "a")
    size = sum(p.stat().st_size for p in directory.iterdir())
    monkeypatch.setitem(limits.PLAN_LIMITS, "free", limits.AdapterLimits(max_adapters=5, max_storage_bytes=size + 10))
    with django_capture_on_commit_callbacks(execute=True):
        assert api.post(f"{BASE}bot/versions/", {"files": two_files(directory)}, format="multipart").status_code == 202
    response = api.post(f"{BASE}bot/versions/", {"files": two_files(write_peft(tmp_path / "b", seed=3))},
                        format="multipart")
    assert response.status_code == 413 and "would exceed the free plan's" in response.json()["detail"]
    assert AdapterVersion.objects.count() == 1


def test_rejected_and_retired_versions_free_their_storage(adapter, member, tmp_path, tenant) -> None:
    version = adapter_version_upload(adapter=adapter, files=two_files(write_peft(tmp_path / "a")), actor=member)
    assert limits.tenant_storage_used(tenant=tenant) == version.size_bytes > 0
    AdapterVersion.objects.filter(pk=version.pk).update(status="rejected")
    assert limits.tenant_storage_used(tenant=tenant) == 0


@pytest.mark.parametrize("how", ["content-length", "streamed"])
def test_the_upload_size_limit_is_a_413(api, adapter, tmp_path, settings, storage_root, how) -> None:
    directory = write_peft(tmp_path / "a")
    settings.MAX_UPLOAD_BYTES = 1000
    if how == "content-length":  # declared up front: refused before reading the body
        data = zip_dir(directory) + bytes(2 << 20)
        response = api.post(f"{BASE}bot/versions/", {"files": [upload("a.zip", data)]}, format="multipart")
    else:  # within the slack for multipart framing: the upload handler stops it while streaming
        response = api.post(f"{BASE}bot/versions/", {"files": two_files(directory)}, format="multipart")
    assert response.status_code == 413, response.content
    assert "limit of 1000 bytes" in response.json()["detail"]
    assert not AdapterVersion.objects.exists() and not list(storage_root.rglob("*.*"))


def test_the_service_caps_what_it_streams(adapter, member, tmp_path, settings, storage_root) -> None:
    files = two_files(write_peft(tmp_path / "a"))
    for f in files:  # the declared sizes lie
        f.size = 1
    settings.MAX_UPLOAD_BYTES = 500
    with pytest.raises(limits.LimitExceeded) as info:
        adapter_version_upload(adapter=adapter, files=files, actor=member)
    assert info.value.status_code == 413
    assert not AdapterVersion.objects.exists() and not [p for p in storage_root.rglob("*") if p.is_file()]


# --- access ------------------------------------------------------------------------------------


def test_a_viewer_reads_but_cannot_write(adapter, ready, tenant, django_user_model, tmp_path) -> None:
    viewer = django_user_model.objects.create_user(username="vic")
    membership_create(tenant=tenant, user=viewer, role=Membership.Role.VIEWER)
    client = client_for(viewer)
    assert client.get(BASE).status_code == 200
    assert client.get(f"{BASE}bot/versions/").json()["count"] == 2
    assert client.get(f"{BASE}bot/deployment/").status_code == 200
    writes = [
        client.post(f"{BASE}bot/versions/", {"files": two_files(write_peft(tmp_path / "x", seed=5))}, format="multipart"),
        client.post(BASE, {"name": "new"}, format="json"),
        client.patch(f"{BASE}bot/", {"description": "x"}, format="json"),
        client.delete(f"{BASE}bot/"),
        client.put(f"{BASE}bot/deployment/", {"weights": {"1": 1}}, format="json"),
        client.post(f"{BASE}bot/versions/1/retire/"),
    ]
    for response in writes:
        assert response.status_code == 403 and "read-only" in response.json()["detail"], response.json()
    assert AdapterVersion.objects.filter(status="ready").count() == 2 and Adapter.objects.count() == 1


@pytest.mark.parametrize("role", ["member", "admin", "owner"])
def test_members_admins_and_owners_write(tenant, django_user_model, role) -> None:
    user = django_user_model.objects.create_user(username=f"u-{role}")
    membership_create(tenant=tenant, user=user, role=role)
    assert client_for(user).post(BASE, {"name": f"by-{role}"}, format="json").status_code == 201


def test_another_tenant_gets_404_everywhere(adapter, ready, django_user_model) -> None:
    globex = tenant_create(slug="globex", name="Globex")
    outsider = django_user_model.objects.create_user(username="otto")
    membership_create(tenant=globex, user=outsider, role=Membership.Role.OWNER)
    for client in (client_for(outsider), key_client(globex)):
        for method, url in [
            ("get", BASE), ("post", BASE), ("get", f"{BASE}bot/"), ("delete", f"{BASE}bot/"),
            ("get", f"{BASE}bot/versions/"), ("get", f"{BASE}bot/versions/1/"), ("get", f"{BASE}bot/versions/1/status/"),
            ("post", f"{BASE}bot/versions/"), ("post", f"{BASE}bot/versions/1/retire/"),
            ("get", f"{BASE}bot/deployment/"), ("put", f"{BASE}bot/deployment/"),
            ("get", "/api/v1/tenants/acme/audit-events/"), ("get", "/api/v1/tenants/no-such-tenant/adapters/"),
        ]:  # fmt: skip
            response = getattr(client, method)(url, {}, format="json")
            assert response.status_code == 404, (method, url, response.status_code)
        # its own tenant works and does not see acme's adapters
        assert client.get("/api/v1/tenants/globex/adapters/").json()["count"] == 0
    assert adapter_version_resolve(tenant=globex, model="acme/bot") is None
    assert Adapter.objects.count() == 1 and AdapterVersion.objects.filter(status="ready").count() == 2


def test_anonymous_is_401(adapter) -> None:
    response = APIClient().get(BASE)
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")


def test_staff_read_any_tenant_but_write_only_as_members(adapter, django_user_model) -> None:
    staff = django_user_model.objects.create_user(username="root", is_staff=True)
    client = client_for(staff)
    assert client.get(BASE).status_code == 200
    assert client.post(BASE, {"name": "x"}, format="json").status_code == 404


def test_api_key_auth(tenant, adapter, tmp_path, django_capture_on_commit_callbacks) -> None:
    client = key_client(tenant)
    assert client.get(BASE).json()["count"] == 1
    assert client.post(BASE, {"name": "from-ci"}, format="json").status_code == 201
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"{BASE}bot/versions/", {"files": [upload("a.zip", zip_dir(write_peft(tmp_path / "a")))]},
                               format="multipart")
    assert response.status_code == 202
    assert client.get(f"{BASE}bot/versions/1/status/").json()["status"] == "ready"


def test_bad_api_keys_are_401(tenant, adapter) -> None:
    key, plaintext = api_key_create(tenant=tenant, name="old")
    api_key_revoke(api_key=key)
    for header in (f"Bearer {plaintext}", "Bearer sk-not-a-real-key-at-all", "Bearer", "Bearer a b"):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=header)
        response = client.get(BASE)
        assert response.status_code == 401 and response.json()["detail"], header


def test_a_suspended_tenant(tenant, adapter, api) -> None:
    client = key_client(tenant)
    tenant_suspend(tenant=tenant)
    assert client.get(BASE).status_code == 403
    assert api.get(BASE).status_code == 200  # members still see their adapters
    assert api.post(BASE, {"name": "x"}, format="json").status_code == 403


# --- deployment ----------------------------------------------------------------------------------


def test_deployment_weights(api, adapter, ready) -> None:
    url = f"{BASE}bot/deployment/"
    assert api.get(url).json()["weights"] == {}
    response = api.put(url, {"weights": {"1": 90, "v2": 10}}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["weights"] == {"1": 90, "2": 10}
    assert Deployment.objects.get(adapter=adapter).weights == {"1": 90, "2": 10}
    assert AuditEvent.objects.filter(action="deployment.weights_set").exists()
    assert api.put(url, {"weights": {}}, format="json").json()["weights"] == {}  # back to the newest ready


@pytest.mark.parametrize(
    "weights", [{"3": 10}, {"1": -1}, {"1": 0, "2": 0}, {"x": 1}, {"1": "a"}, {"1": 1.5}, [1, 2], "90/10"]
)
def test_bad_deployment_weights_are_400s(api, adapter, ready, weights) -> None:
    response = api.put(f"{BASE}bot/deployment/", {"weights": weights}, format="json")
    assert response.status_code == 400 and response.json()["detail"], response.json()
    assert Deployment.objects.get(adapter=adapter).weights == {}


# --- retire and delete ---------------------------------------------------------------------------


def test_retire_makes_a_version_unresolvable(api, adapter, ready, tenant, storage_root, staging_calls) -> None:
    v1, v2 = ready
    api.put(f"{BASE}bot/deployment/", {"weights": {"1": 50, "2": 50}}, format="json")
    response = api.post(f"{BASE}bot/versions/2/retire/")
    assert response.status_code == 200 and response.json()["status"] == "retired" and response.json()["retired_at"]
    assert adapter_version_resolve(tenant=tenant, model="acme/bot@v2") is None
    assert adapter_version_resolve(tenant=tenant, model="acme/bot").version == v1
    assert Deployment.objects.get(adapter=adapter).weights == {"1": 50}
    assert AuditEvent.objects.filter(action="version.retired", target="acme/bot@v2").exists()
    assert api.post(f"{BASE}bot/versions/2/retire/").status_code == 200  # idempotent
    api.delete(f"{BASE}bot/versions/1/")  # DELETE = retire
    assert adapter_version_resolve(tenant=tenant, model="acme/bot") is None
    assert list(adapter_list_servable(tenant=tenant)) == []


def test_retire_unstages_and_frees_storage_after_commit(
    api, adapter, ready, storage_root, staging_calls, django_capture_on_commit_callbacks
) -> None:
    v1, v2 = ready
    with django_capture_on_commit_callbacks(execute=True):
        api.post(f"{BASE}bot/versions/2/retire/")
    assert staging_calls["unstage"] == [v2.uid]
    assert not (storage_root / v2.storage_dir).exists() and (storage_root / v1.storage_dir).exists()


def test_delete_an_adapter(api, adapter, ready, tenant, storage_root, staging_calls,
                           django_capture_on_commit_callbacks) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        assert api.delete(f"{BASE}bot/").status_code == 204
    assert not Adapter.objects.exists() and not AdapterVersion.objects.exists()
    assert sorted(staging_calls["unstage"]) == sorted(v.uid for v in ready)
    assert not [p for p in storage_root.rglob("*") if p.is_file()]
    assert adapter_version_resolve(tenant=tenant, model="acme/bot@v1") is None
    assert AuditEvent.objects.filter(action="adapter.deleted", target="acme/bot").exists()
    assert api.get(f"{BASE}bot/").status_code == 404


# --- schema ----------------------------------------------------------------------------------------


def test_the_openapi_schema_renders_with_every_route(api) -> None:
    anonymous = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert anonymous.status_code == 401  # only signed-in users and API keys read it
    response = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    schema = response.json()
    paths = set(schema["paths"])
    prefix = "/api/v1/tenants/{tenant_slug}/adapters"
    assert {
        f"{prefix}/", f"{prefix}/{{name}}/", f"{prefix}/{{name}}/deployment/", f"{prefix}/{{adapter_name}}/versions/",
        f"{prefix}/{{adapter_name}}/versions/{{number}}/", f"{prefix}/{{adapter_name}}/versions/{{number}}/status/",
        f"{prefix}/{{adapter_name}}/versions/{{number}}/retire/", "/api/v1/tenants/{tenant_slug}/audit-events/",
    } <= paths  # fmt: skip
    upload_op = schema["paths"][f"{prefix}/{{adapter_name}}/versions/"]["post"]
    assert "multipart/form-data" in upload_op["requestBody"]["content"]
    assert "ApiKeyAuth" in schema["components"]["securitySchemes"]
    assert set(schema["paths"][f"{prefix}/{{name}}/deployment/"]) >= {"get", "put"}


def test_always_warm_is_plan_gated(api, adapter, ready) -> None:
    response = api.put(f"{BASE}bot/deployment/", {"always_warm": True}, format="json")
    assert response.status_code == 403 and response.json()["code"] == "limit_exceeded", response.json()
    assert "free plan allows 0 always-warm adapters" in response.json()["detail"]
    assert Deployment.objects.get(adapter=adapter).always_warm is False
    assert api.put(f"{BASE}bot/deployment/", {}, format="json").status_code == 400

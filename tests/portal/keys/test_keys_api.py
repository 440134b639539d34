"""The keys REST API: create (the secret once), list, get, revoke, rotate with a grace period,
per-key allow-lists, expiry and limits; roles, other tenants, API-key callers; the schema."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate
from portal.keys.services import api_key_create, api_key_end_grace
from portal.quotas.models import Quota
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create

pytestmark = pytest.mark.django_db
KEYS = "/api/v1/tenants/acme/keys/"


def signed_in(django_user_model, tenant, role: str, username: str) -> APIClient:
    user = django_user_model.objects.create_user(username=username, password="x")
    membership_create(tenant=tenant, user=user, role=role)
    client = APIClient()
    client.force_login(user)
    return client


@pytest.fixture
def api(tenant, django_user_model) -> APIClient:
    return signed_in(django_user_model, tenant, Membership.Role.MEMBER, "mia")


@pytest.fixture
def viewer(tenant, django_user_model) -> APIClient:
    return signed_in(django_user_model, tenant, Membership.Role.VIEWER, "vic")


def create(api: APIClient, **body) -> dict:
    response = api.post(KEYS, {"name": "ci", **body}, format="json")
    assert response.status_code == 201, response.json()
    return response.json()


def test_create_shows_the_secret_once_and_list_and_get_never(api) -> None:
    created = create(api, allowed_models=["acme/bot", "smollm2"], expires_at="2099-01-01T00:00:00Z",
                     limits={"monthly_token_budget": 1_000_000, "monthly_spend_limit": "25.50"})

    secret = created["key"]
    assert secret.startswith("sk-") and api_key_authenticate(secret).pk == created["id"]
    assert created["display_prefix"] == f"{secret[:11]}…" and created["created_by"] == "mia"
    assert (created["status"], created["allowed_models"], created["currency"]) == (
        "active", ["acme/bot", "smollm2"], "USD")
    assert created["expires_at"] == "2099-01-01T00:00:00Z"
    assert created["limits"]["monthly_token_budget"] == 1_000_000
    assert Decimal(created["limits"]["monthly_spend_limit"]) == Decimal("25.50")
    assert Quota.objects.get(api_key_id=created["id"]).monthly_spend_limit == Decimal("25.50")

    listed = api.get(KEYS).json()["results"]
    fetched = api.get(f"{KEYS}{created['id']}/").json()
    assert [k["id"] for k in listed] == [created["id"]]
    assert "key" not in listed[0] and "key" not in fetched
    assert secret[3:] not in str(listed) + str(fetched)
    assert fetched == {name: value for name, value in created.items() if name != "key"}


def test_a_key_without_limits_has_no_quota_row_and_null_limits(api) -> None:
    created = create(api)

    assert created["allowed_models"] is None and created["expires_at"] is None
    assert set(created["limits"].values()) == {None}
    assert not Quota.objects.filter(api_key_id=created["id"]).exists()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "k", "expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
        ({"name": "k", "allowed_models": []}, "allowed_models"),
        ({"name": "k", "allowed_models": ["acme/bot", "acme/bot"]}, "allowed_models"),
        ({"name": "k", "limits": {"monthly_spend_limit": "-1"}}, "limits"),
        ({"name": "k", "limits": {"monthly_spend_limit": "0.0000001"}}, "limits"),
        ({"name": "k", "limits": {"monthly_token_budget": -5}}, "limits"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_creates_nothing(api, body, field) -> None:
    response = api.post(KEYS, body, format="json")

    assert response.status_code == 400, response.json()
    error = response.json()
    assert error.get("field") == field or field in error.get("errors", {}), error
    assert not ApiKey.objects.exists() and not Quota.objects.exists()


def test_revoke_by_post_or_delete_ends_the_key(api) -> None:
    first, second = create(api), create(api, name="other")

    revoked = api.post(f"{KEYS}{first['id']}/revoke/")
    deleted = api.delete(f"{KEYS}{second['id']}/")

    assert revoked.status_code == deleted.status_code == 200
    assert revoked.json()["status"] == deleted.json()["status"] == "revoked"
    assert api_key_authenticate(first["key"]) is None and api_key_authenticate(second["key"]) is None
    assert api.get(f"{KEYS}{first['id']}/").json()["revoked_at"] is not None


def test_rotate_gives_a_new_secret_once_and_the_old_works_until_the_grace_ends(api) -> None:
    created = create(api, limits={"requests_per_minute": 7})

    response = api.post(f"{KEYS}{created['id']}/rotate/", {"grace_period_seconds": 3600}, format="json")

    assert response.status_code == 200, response.json()
    rotated = response.json()
    new, old = rotated["key"], created["key"]
    assert new != old and rotated["id"] == created["id"] and rotated["limits"]["requests_per_minute"] == 7
    until = timezone.datetime.fromisoformat(rotated["previous_secret_valid_until"])
    assert timedelta(minutes=59) < until - timezone.now() <= timedelta(hours=1)
    assert api_key_authenticate(new).pk == api_key_authenticate(old).pk == created["id"]
    assert "key" not in api.get(f"{KEYS}{created['id']}/").json()

    api_key_end_grace(api_key=ApiKey.objects.get(pk=created["id"]), at=timezone.now() - timedelta(seconds=1))

    assert api_key_authenticate(old) is None and api_key_authenticate(new).pk == created["id"]
    assert api.get(f"{KEYS}{created['id']}/").json()["previous_secret_valid_until"] is None


def test_rotate_defaults_to_24_hours_and_zero_ends_the_old_secret_at_once(api) -> None:
    created = create(api)
    default = api.post(f"{KEYS}{created['id']}/rotate/").json()
    until = timezone.datetime.fromisoformat(default["previous_secret_valid_until"])
    assert timedelta(hours=23, minutes=59) < until - timezone.now() <= timedelta(hours=24)

    now = api.post(f"{KEYS}{created['id']}/rotate/", {"grace_period_seconds": 0}, format="json").json()

    assert now["previous_secret_valid_until"] is None
    assert api_key_authenticate(default["key"]) is None and api_key_authenticate(created["key"]) is None
    assert api_key_authenticate(now["key"]).pk == created["id"]


@pytest.mark.parametrize("grace", [-1, 7 * 86400 + 1, "soon"])
def test_a_grace_outside_0_to_7_days_is_refused_and_nothing_changes(api, grace) -> None:
    created = create(api)

    response = api.post(f"{KEYS}{created['id']}/rotate/", {"grace_period_seconds": grace}, format="json")

    assert response.status_code == 400 and "grace_period_seconds" in response.json()["errors"]
    assert api_key_authenticate(created["key"]).pk == created["id"]


def test_a_revoked_key_cannot_be_rotated(api) -> None:
    created = create(api)
    api.post(f"{KEYS}{created['id']}/revoke/")

    response = api.post(f"{KEYS}{created['id']}/rotate/")

    assert response.status_code == 400 and response.json()["field"] == "api_key"


def test_a_viewer_lists_and_reads_but_cannot_create_revoke_or_rotate(api, viewer) -> None:
    created = create(api)

    assert [k["id"] for k in viewer.get(KEYS).json()["results"]] == [created["id"]]
    assert viewer.get(f"{KEYS}{created['id']}/").status_code == 200
    for response in (
        viewer.post(KEYS, {"name": "mine"}, format="json"),
        viewer.post(f"{KEYS}{created['id']}/revoke/"),
        viewer.delete(f"{KEYS}{created['id']}/"),
        viewer.post(f"{KEYS}{created['id']}/rotate/"),
    ):
        assert response.status_code == 403, response.json()
        assert "read-only" in response.json()["detail"]
    assert ApiKey.objects.count() == 1 and api_key_authenticate(created["key"]) is not None


def test_another_tenants_keys_are_invisible(api, django_user_model) -> None:
    globex = tenant_create(slug="globex", name="Globex")
    theirs, _ = api_key_create(tenant=globex, name="theirs")
    outsider = signed_in(django_user_model, globex, Membership.Role.OWNER, "olga")
    create(api)

    assert api.get(f"{KEYS}{theirs.pk}/").status_code == 404
    assert api.post(f"{KEYS}{theirs.pk}/revoke/").status_code == 404
    assert api.post(f"{KEYS}{theirs.pk}/rotate/").status_code == 404
    assert outsider.get(KEYS).status_code == 404  # not a member of acme: as if it did not exist
    assert [k["name"] for k in outsider.get("/api/v1/tenants/globex/keys/").json()["results"]] == ["theirs"]
    assert ApiKey.objects.get(pk=theirs.pk).revoked_at is None


def test_not_signed_in_is_a_401(tenant) -> None:
    assert APIClient().get(KEYS).status_code in (401, 403)
    response = APIClient().get(KEYS, HTTP_AUTHORIZATION="Bearer sk-nope-nope-nope")
    assert response.status_code == 401


def test_an_api_key_manages_keys_unless_it_is_limited_to_some_models(tenant) -> None:
    _, unrestricted = api_key_create(tenant=tenant, name="admin")
    _, narrow = api_key_create(tenant=tenant, name="narrow", allowed_models=["acme/bot"])
    by_key, by_narrow = APIClient(), APIClient()
    by_key.credentials(HTTP_AUTHORIZATION=f"Bearer {unrestricted}")
    by_narrow.credentials(HTTP_AUTHORIZATION=f"Bearer {narrow}")

    made = by_key.post(KEYS, {"name": "made by a key"}, format="json")
    refused = by_narrow.post(KEYS, {"name": "escape"}, format="json")

    assert made.status_code == 201 and made.json()["key"].startswith("sk-")
    assert refused.status_code == 403 and "limited to some models" in refused.json()["detail"]
    assert by_narrow.get(KEYS).status_code == 200
    assert not ApiKey.objects.filter(name="escape").exists()


def test_the_openapi_schema_has_the_keys_routes(api) -> None:
    response = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")

    assert response.status_code == 200
    paths = response.json()["paths"]
    prefix = "/api/v1/tenants/{tenant_slug}/keys"
    assert set(paths[f"{prefix}/"]) >= {"get", "post"}
    assert set(paths[f"{prefix}/{{id}}/"]) >= {"get", "patch", "delete"}
    assert "post" in paths[f"{prefix}/{{id}}/revoke/"] and "post" in paths[f"{prefix}/{{id}}/rotate/"]
    created = paths[f"{prefix}/"]["post"]["responses"]["201"]["content"]["application/json"]["schema"]["$ref"]
    component = response.json()["components"]["schemas"][created.rsplit("/", 1)[1]]
    assert "key" in component["properties"]


def test_patch_changes_only_what_is_sent(api) -> None:
    created = create(api, allowed_models=["acme/bot"], limits={"monthly_token_budget": 500, "requests_per_minute": 9})

    response = api.patch(f"{KEYS}{created['id']}/", {"name": "renamed", "limits": {"monthly_spend_limit": "3.00",
                                                                                  "requests_per_minute": None}},
                         format="json")

    assert response.status_code == 200, response.json()
    body = response.json()
    assert "key" not in body and (body["name"], body["allowed_models"]) == ("renamed", ["acme/bot"])
    assert body["limits"]["monthly_token_budget"] == 500 and body["limits"]["requests_per_minute"] is None
    assert Decimal(body["limits"]["monthly_spend_limit"]) == Decimal("3.00")
    opened = api.patch(f"{KEYS}{created['id']}/", {"allowed_models": None, "expires_at": "2099-01-01T00:00:00Z"},
                       format="json").json()
    assert opened["allowed_models"] is None and opened["expires_at"] == "2099-01-01T00:00:00Z"
    assert opened["limits"]["monthly_token_budget"] == 500
    assert api_key_authenticate(created["key"]).name == "renamed"


@pytest.mark.parametrize(
    ("body", "field"),
    [({}, "non_field_errors"), ({"expires_at": "2001-01-01T00:00:00Z"}, "expires_at"),
     ({"allowed_models": []}, "allowed_models"), ({"limits": {"monthly_spend_limit": "-0.01"}}, "limits")],
)
def test_a_bad_patch_is_a_400_and_changes_nothing(api, body, field) -> None:
    created = create(api, limits={"monthly_token_budget": 500})

    response = api.patch(f"{KEYS}{created['id']}/", body, format="json")

    assert response.status_code == 400, response.json()
    error = response.json()
    assert error.get("field") == field or field in error.get("errors", {}), error
    assert api.get(f"{KEYS}{created['id']}/").json() == {k: v for k, v in created.items() if k != "key"}


def test_a_viewer_cannot_patch(api, viewer) -> None:
    created = create(api)

    assert viewer.patch(f"{KEYS}{created['id']}/", {"name": "mine"}, format="json").status_code == 403
    assert api.get(f"{KEYS}{created['id']}/").json()["name"] == "ci"

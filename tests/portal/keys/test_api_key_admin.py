"""Staff create and revoke keys in the Django admin; the secret is shown once, as a message."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate
from portal.keys.services import api_key_create

pytestmark = pytest.mark.django_db


def test_admin_add_creates_a_key_through_the_service_and_shows_its_secret_once(
    admin_client, admin_user, tenant
):
    response = admin_client.post(
        "/admin/keys/apikey/add/",
        {
            "tenant": tenant.pk,
            "name": "from-admin",
            "expires_at_0": "",
            "expires_at_1": "",
            "allowed_models": "null",
        },
        follow=True,
    )

    assert response.status_code == 200
    shown = [str(message) for message in response.context["messages"]]
    plaintexts = re.findall(r"sk-[A-Za-z0-9_-]{43}", " ".join(shown))
    assert len(plaintexts) == 1
    api_key = ApiKey.objects.get()
    assert api_key_authenticate(plaintexts[0]) == api_key
    assert (api_key.name, api_key.created_by) == ("from-admin", admin_user)

    page = admin_client.get(f"/admin/keys/apikey/{api_key.pk}/change/").content.decode()
    assert plaintexts[0] not in page
    assert api_key.display_prefix in page


def test_admin_add_refuses_a_past_expiry_with_a_form_error(admin_client, tenant):
    past = timezone.now() - timedelta(days=1)
    response = admin_client.post(
        "/admin/keys/apikey/add/",
        {
            "tenant": tenant.pk,
            "name": "late",
            "expires_at_0": past.strftime("%Y-%m-%d"),
            "expires_at_1": past.strftime("%H:%M:%S"),
            "allowed_models": "null",
        },
    )

    assert response.status_code == 200
    assert "must expire in the future" in response.content.decode()
    assert not ApiKey.objects.exists()


def test_admin_add_refuses_an_empty_model_allow_list(admin_client, tenant):
    response = admin_client.post(
        "/admin/keys/apikey/add/",
        {
            "tenant": tenant.pk,
            "name": "k",
            "expires_at_0": "",
            "expires_at_1": "",
            "allowed_models": "[]",
        },
    )

    assert response.status_code == 200
    assert "non-empty list" in response.content.decode()
    assert not ApiKey.objects.exists()


def test_admin_revoke_action(admin_client, tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="ci")

    response = admin_client.post(
        "/admin/keys/apikey/", {"action": "revoke", "_selected_action": [api_key.pk]}, follow=True
    )

    assert response.status_code == 200
    assert api_key_authenticate(plaintext) is None

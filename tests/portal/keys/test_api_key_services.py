import hashlib
from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core.exceptions import InvalidInput
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate, api_key_list
from portal.keys.services import api_key_create, api_key_record_use, api_key_revoke
from portal.tenants.services import tenant_create, tenant_suspend

pytestmark = pytest.mark.django_db


def test_create_returns_the_plaintext_once_and_stores_only_its_hash(tenant, user):
    api_key, plaintext = api_key_create(tenant=tenant, name="ci", created_by=user)

    assert plaintext.startswith("sk-") and len(plaintext) == 3 + 43  # 32 random bytes, base64url
    assert api_key.prefix == plaintext[3:11]
    assert api_key.display_prefix == f"sk-{plaintext[3:11]}…"
    stored = ApiKey.objects.filter(pk=api_key.pk).values().get()
    assert stored["secret_hash"] == hashlib.sha256(plaintext.encode()).hexdigest()
    assert all(plaintext[3:] not in str(value) for value in stored.values())
    assert (stored["name"], stored["created_by_id"], stored["tenant_id"]) == (
        "ci",
        user.pk,
        tenant.pk,
    )


def test_every_key_gets_a_different_secret(tenant):
    secrets = {api_key_create(tenant=tenant, name="k")[1] for _ in range(5)}

    assert len(secrets) == 5


def test_authenticate_by_plaintext_returns_the_key_with_its_tenant(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="ci")

    found = api_key_authenticate(plaintext)

    assert found == api_key
    assert found.tenant.slug == "acme"


@pytest.mark.parametrize("attempt", ["", "sk-", "sk-short", "Bearer sk-x", "x" * 10_000])
def test_authenticate_rejects_malformed_input(tenant, attempt):
    api_key_create(tenant=tenant, name="ci")

    assert api_key_authenticate(attempt) is None


def test_authenticate_rejects_a_wrong_secret_with_the_right_prefix(tenant):
    _, plaintext = api_key_create(tenant=tenant, name="ci")
    tampered = plaintext[:-1] + ("A" if plaintext[-1] != "A" else "B")

    assert api_key_authenticate(tampered) is None


def test_revoked_key_is_rejected_and_revoking_again_keeps_the_first_time(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="ci")

    api_key_revoke(api_key=api_key)
    first_revocation = api_key.revoked_at
    api_key_revoke(api_key=ApiKey.objects.get(pk=api_key.pk))

    assert api_key_authenticate(plaintext) is None
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at == first_revocation


def test_expired_key_is_rejected_and_unexpired_key_accepted(tenant):
    api_key, plaintext = api_key_create(
        tenant=tenant, name="ci", expires_at=timezone.now() + timedelta(hours=1)
    )
    assert api_key_authenticate(plaintext) == api_key

    ApiKey.objects.filter(pk=api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    assert api_key_authenticate(plaintext) is None


def test_suspended_tenants_keys_still_authenticate_for_the_caller_to_refuse(tenant):
    api_key, plaintext = api_key_create(tenant=tenant, name="ci")
    tenant_suspend(tenant=tenant)

    found = api_key_authenticate(plaintext)
    assert found == api_key and not found.tenant.is_active


def test_create_rejects_a_past_or_naive_expiry(tenant):
    with pytest.raises(InvalidInput, match="must be in the future") as caught:
        api_key_create(tenant=tenant, name="ci", expires_at=timezone.now() - timedelta(minutes=1))
    assert caught.value.field == "expires_at"

    with pytest.raises(InvalidInput, match="time zone"):
        api_key_create(tenant=tenant, name="ci", expires_at=timezone.now().replace(tzinfo=None))
    assert not ApiKey.objects.exists()


def test_create_validates_name(tenant):
    for name in ["", "   ", "n" * 101]:
        with pytest.raises(InvalidInput) as caught:
            api_key_create(tenant=tenant, name=name)
        assert caught.value.field == "name"


def test_allowed_models_are_kept_and_validated(tenant):
    api_key, _ = api_key_create(
        tenant=tenant, name="ci", allowed_models=["acme/bot", "acme/bot@v2"]
    )
    assert ApiKey.objects.get(pk=api_key.pk).allowed_models == ["acme/bot", "acme/bot@v2"]
    assert api_key_create(tenant=tenant, name="any")[0].allowed_models is None

    cases = [
        ([], "allowed_models"),
        ("acme/bot", "allowed_models"),
        (["acme/bot", ""], "allowed_models[1]"),
        (["a", 3], "allowed_models[1]"),
        (["a", "a"], "allowed_models"),
    ]
    for allowed_models, field in cases:
        with pytest.raises(InvalidInput) as caught:
            api_key_create(tenant=tenant, name="ci", allowed_models=allowed_models)
        assert caught.value.field == field


def test_record_use_writes_at_most_once_a_minute(tenant):
    api_key, _ = api_key_create(tenant=tenant, name="ci")

    assert api_key_record_use(api_key=api_key) is True
    first_use = ApiKey.objects.get(pk=api_key.pk).last_used_at
    assert first_use is not None
    assert api_key_record_use(api_key=api_key) is False

    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=first_use - timedelta(minutes=2))
    assert api_key_record_use(api_key=ApiKey.objects.get(pk=api_key.pk)) is True
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at > first_use - timedelta(minutes=2)


def test_api_key_list_filters_usable_keys_of_one_tenant(tenant):
    live, _ = api_key_create(tenant=tenant, name="live")
    revoked, _ = api_key_create(tenant=tenant, name="revoked")
    api_key_revoke(api_key=revoked)
    expired, _ = api_key_create(
        tenant=tenant, name="expired", expires_at=timezone.now() + timedelta(hours=1)
    )
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(hours=1))
    api_key_create(tenant=tenant_create(slug="globex", name="Globex"), name="other")

    assert set(api_key_list(tenant=tenant)) == {live, revoked, expired}
    assert list(api_key_list(tenant=tenant, usable_only=True)) == [live]

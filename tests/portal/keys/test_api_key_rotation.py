"""Rotation: a new secret, the old one valid for a grace period only; why a known secret fails."""

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.core.exceptions import InvalidInput
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate, api_key_refusal_reason
from portal.keys.services import (
    MAX_ROTATION_GRACE,
    api_key_create,
    api_key_end_grace,
    api_key_revoke,
    api_key_rotate,
)

pytestmark = pytest.mark.django_db


def test_rotation_keeps_the_key_and_its_settings_and_changes_only_the_secret(tenant):
    api_key, old = api_key_create(tenant=tenant, name="ci", allowed_models=["acme/bot"])

    rotated, new = api_key_rotate(api_key=api_key, grace=timedelta(minutes=5))

    assert new != old and new.startswith("sk-") and rotated.pk == api_key.pk
    assert rotated.prefix == new[3:11] and rotated.allowed_models == ["acme/bot"]
    assert api_key_authenticate(old).pk == api_key_authenticate(new).pk == api_key.pk
    stored = ApiKey.objects.get(pk=api_key.pk)
    assert old[3:] not in str(ApiKey.objects.filter(pk=api_key.pk).values().get()) and stored.rotated_at


def test_the_old_secret_fails_after_the_grace_and_says_why(tenant):
    api_key, old = api_key_create(tenant=tenant, name="ci")
    api_key, new = api_key_rotate(api_key=api_key)  # the default: 24 h
    assert timedelta(hours=23, minutes=59) < api_key.previous_valid_until - timezone.now() <= timedelta(hours=24)

    api_key_end_grace(api_key=api_key, at=timezone.now() - timedelta(seconds=1))

    assert api_key_authenticate(old) is None and api_key_authenticate(new).pk == api_key.pk
    assert "rotated" in api_key_refusal_reason(old) and api_key_refusal_reason(new) is None


def test_a_second_rotation_ends_the_first_old_secret_at_once(tenant):
    api_key, first = api_key_create(tenant=tenant, name="ci")
    api_key, second = api_key_rotate(api_key=api_key)
    api_key, third = api_key_rotate(api_key=api_key)

    assert api_key_authenticate(first) is None
    assert api_key_authenticate(second).pk == api_key_authenticate(third).pk == api_key.pk


def test_revoking_ends_the_old_secret_in_its_grace_too(tenant):
    api_key, old = api_key_create(tenant=tenant, name="ci")
    api_key, new = api_key_rotate(api_key=api_key)

    api_key_revoke(api_key=api_key)

    assert api_key_authenticate(old) is None and api_key_authenticate(new) is None
    assert api_key_refusal_reason(old) == api_key_refusal_reason(new) == "This API key was revoked."


@pytest.mark.parametrize("grace", [timedelta(seconds=-1), MAX_ROTATION_GRACE + timedelta(seconds=1), 3600])
def test_a_grace_outside_the_range_is_refused_and_the_secret_kept(tenant, grace):
    api_key, old = api_key_create(tenant=tenant, name="ci")

    with pytest.raises(InvalidInput) as error:
        api_key_rotate(api_key=api_key, grace=grace)

    assert error.value.field == "grace_period_seconds"
    assert api_key_authenticate(old).pk == api_key.pk


def test_an_expired_key_says_it_expired_and_cannot_be_rotated(tenant):
    api_key, secret = api_key_create(tenant=tenant, name="ci", expires_at=timezone.now() + timedelta(minutes=1))
    ApiKey.objects.filter(pk=api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    api_key.refresh_from_db()

    assert api_key_refusal_reason(secret).startswith("This API key expired at ")
    with pytest.raises(InvalidInput):
        api_key_rotate(api_key=api_key)


def test_an_unknown_secret_has_no_reason(tenant):
    assert api_key_refusal_reason("sk-" + "x" * 43) is None and api_key_refusal_reason("nonsense") is None

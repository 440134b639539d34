"""Writes on API keys."""

from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from portal.core.exceptions import InvalidInput, full_clean_or_raise
from portal.keys.hashing import hash_key, new_plaintext_key, visible_prefix
from portal.keys.models import ApiKey
from portal.tenants.models import Tenant

# last_used_at is for humans ("used 3 minutes ago"); writing it on every request would put a
# row update on the hot path of the gateway, so it is refreshed at most this often.
LAST_USED_RESOLUTION = timedelta(seconds=60)
# After a rotation the old secret keeps working this long unless the caller asks otherwise
# (0 ends it at once); a longer grace than the maximum would make rotation pointless.
DEFAULT_ROTATION_GRACE = timedelta(hours=24)
MAX_ROTATION_GRACE = timedelta(days=7)


@transaction.atomic
def api_key_create(
    *,
    tenant: Tenant,
    name: str,
    created_by: AbstractBaseUser | None = None,
    expires_at: datetime | None = None,
    allowed_models: list[str] | None = None,
) -> tuple[ApiKey, str]:
    """Create a key; returns it with its plaintext, which is not stored and cannot be shown again."""
    if expires_at is not None:
        if timezone.is_naive(expires_at):
            raise InvalidInput("expires_at", "must carry a time zone")
        if expires_at <= timezone.now():
            raise InvalidInput("expires_at", f"must be in the future, got {expires_at.isoformat()}")
    validate_allowed_models(allowed_models)

    plaintext = new_plaintext_key()
    api_key = ApiKey(
        tenant=tenant,
        name=name.strip(),
        prefix=visible_prefix(plaintext),
        secret_hash=hash_key(plaintext),
        created_by=created_by,
        expires_at=expires_at,
        allowed_models=list(allowed_models) if allowed_models is not None else None,
    )
    full_clean_or_raise(api_key)
    api_key.save()
    return api_key, plaintext


# Passed for a field api_key_update should leave as it is (None means "none": no expiry, any model).
UNCHANGED: Any = object()


@transaction.atomic
def api_key_update(
    *,
    api_key: ApiKey,
    name: str | None = None,
    expires_at: datetime | None = UNCHANGED,
    allowed_models: list[str] | None = UNCHANGED,
) -> ApiKey:
    """Rename a key, or change its expiry (None: never) or allow-list (None: any model).
    A revoked key stays revoked; an expiry must be in the future, as at creation."""
    changes: dict[str, Any] = {}
    if name is not None and name.strip() != api_key.name:
        changes["name"] = name.strip()
    if expires_at is not UNCHANGED and expires_at != api_key.expires_at:
        if expires_at is not None and (timezone.is_naive(expires_at) or expires_at <= timezone.now()):
            raise InvalidInput("expires_at", f"must be a time-zoned time in the future, got {expires_at.isoformat()}")
        changes["expires_at"] = expires_at
    if allowed_models is not UNCHANGED and allowed_models != api_key.allowed_models:
        validate_allowed_models(allowed_models)
        changes["allowed_models"] = list(allowed_models) if allowed_models is not None else None
    if not changes:
        return api_key
    for field_name, value in changes.items():
        setattr(api_key, field_name, value)
    full_clean_or_raise(api_key)
    api_key.save(update_fields=list(changes))
    return api_key


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke a key for good, its secret and any previous one still in its grace period;
    revoking twice keeps the first revocation time."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
    return api_key


@transaction.atomic
def api_key_rotate(*, api_key: ApiKey, grace: timedelta = DEFAULT_ROTATION_GRACE) -> tuple[ApiKey, str]:
    """Give the key a new secret (returned once, like at creation). The secret it replaces keeps
    authenticating for `grace` (0: not at all); a secret from an earlier rotation ends now.
    The key keeps its id, name, allow-list, expiry, quotas and usage."""
    if not isinstance(grace, timedelta) or not timedelta(0) <= grace <= MAX_ROTATION_GRACE:
        raise InvalidInput(
            "grace_period_seconds",
            f"must be between 0 and {int(MAX_ROTATION_GRACE.total_seconds())} seconds, got {grace!r}",
        )
    api_key = ApiKey.objects.select_for_update().get(pk=api_key.pk)
    if not api_key.is_usable():
        raise InvalidInput("api_key", "a revoked or expired key cannot be rotated; create a new one")
    now = timezone.now()
    plaintext = new_plaintext_key()
    api_key.previous_secret_hash = api_key.secret_hash if grace else None
    api_key.previous_valid_until = now + grace if grace else None
    api_key.secret_hash = hash_key(plaintext)
    api_key.prefix = visible_prefix(plaintext)
    api_key.rotated_at = now
    api_key.save(update_fields=["previous_secret_hash", "previous_valid_until", "secret_hash", "prefix", "rotated_at"])
    return api_key, plaintext


def api_key_end_grace(*, api_key: ApiKey, at: datetime | None = None) -> ApiKey:
    """End the rotated-out secret's grace period at `at` (default now; never later than planned)."""
    end = at or timezone.now()
    if api_key.previous_valid_until is not None and end < api_key.previous_valid_until:
        api_key.previous_valid_until = end
        api_key.save(update_fields=["previous_valid_until"])
    return api_key


def api_key_record_use(*, api_key: ApiKey) -> bool:
    """Refresh last_used_at unless it was refreshed recently; True when a row was written."""
    now = timezone.now()
    if api_key.last_used_at is not None and now - api_key.last_used_at < LAST_USED_RESOLUTION:
        return False
    updated = ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=now)
    api_key.last_used_at = now
    return updated == 1


def validate_allowed_models(allowed_models: list[str] | None) -> None:
    if allowed_models is None:
        return
    if not isinstance(allowed_models, list | tuple) or not allowed_models:
        raise InvalidInput(
            "allowed_models", "must be None (any model) or a non-empty list of model ids"
        )
    for index, model_id in enumerate(allowed_models):
        if not isinstance(model_id, str) or not model_id.strip():
            raise InvalidInput(f"allowed_models[{index}]", f"not a model id: {model_id!r}")
    if len(set(allowed_models)) != len(allowed_models):
        raise InvalidInput("allowed_models", "lists a model twice")

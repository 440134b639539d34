"""Writes on API keys."""

from datetime import datetime, timedelta

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


def api_key_revoke(*, api_key: ApiKey) -> ApiKey:
    """Revoke a key for good; revoking twice keeps the first revocation time."""
    if api_key.revoked_at is None:
        api_key.revoked_at = timezone.now()
        api_key.save(update_fields=["revoked_at"])
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

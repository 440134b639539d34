"""Reads on API keys."""

from django.db.models import Q, QuerySet
from django.utils import timezone

from portal.keys.hashing import hash_key, looks_like_key
from portal.keys.models import ApiKey
from portal.tenants.models import Tenant


def api_key_authenticate(plaintext: str) -> ApiKey | None:
    """The usable key with this secret, or None (unknown, revoked or expired).

    The tenant comes loaded; whether it is suspended is the caller's check (403, not 401).
    """
    if not looks_like_key(plaintext):
        return None
    return (
        _usable(ApiKey.objects.all())
        .select_related("tenant")
        .filter(secret_hash=hash_key(plaintext))
        .first()
    )


def api_key_is_usable(plaintext: str) -> bool:
    """Whether this secret may act now: a usable key of an active tenant."""
    api_key = api_key_authenticate(plaintext)
    return api_key is not None and api_key.tenant.is_active


def api_key_list(*, tenant: Tenant, usable_only: bool = False) -> QuerySet[ApiKey]:
    keys = ApiKey.objects.filter(tenant=tenant).order_by("-created_at")
    return _usable(keys) if usable_only else keys


def _usable(keys: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
    return keys.filter(revoked_at__isnull=True).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    )

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
    return _usable(_by_secret(plaintext)).select_related("tenant").first()


def api_key_refusal_reason(plaintext: str) -> str | None:
    """Why this secret does not authenticate, when it is one we know (revoked, expired, rotated
    out): the 401 says so rather than only "incorrect". None for an unknown secret."""
    if not looks_like_key(plaintext):
        return None
    api_key = _by_secret(plaintext, include_past_grace=True).first()
    if api_key is None:
        return None
    if api_key.revoked_at is not None:
        return "This API key was revoked."
    if api_key.expires_at is not None and api_key.expires_at <= timezone.now():
        return f"This API key expired at {api_key.expires_at.isoformat()}."
    if api_key.previous_secret_hash == hash_key(plaintext):
        return (
            "This API key was rotated and its previous secret's grace period ended at "
            f"{api_key.previous_valid_until.isoformat()}; use the new secret."
        )
    return None


def api_key_is_usable(plaintext: str) -> bool:
    """Whether this secret may act now: a usable key of an active tenant."""
    api_key = api_key_authenticate(plaintext)
    return api_key is not None and api_key.tenant.is_active


def api_key_list(*, tenant: Tenant, usable_only: bool = False) -> QuerySet[ApiKey]:
    keys = ApiKey.objects.filter(tenant=tenant).order_by("-created_at")
    return _usable(keys) if usable_only else keys


def api_key_get(*, tenant: Tenant, pk: int) -> ApiKey | None:
    """One of the tenant's keys (another tenant's is as absent as a missing one)."""
    return ApiKey.objects.filter(tenant=tenant, pk=pk).first()


def _by_secret(plaintext: str, *, include_past_grace: bool = False) -> QuerySet[ApiKey]:
    """Keys whose current secret is this, or whose rotated-out secret is (still in its grace)."""
    digest = hash_key(plaintext)
    previous = Q(previous_secret_hash=digest)
    if not include_past_grace:
        previous &= Q(previous_valid_until__gt=timezone.now())
    return ApiKey.objects.filter(Q(secret_hash=digest) | previous)


def _usable(keys: QuerySet[ApiKey]) -> QuerySet[ApiKey]:
    return keys.filter(revoked_at__isnull=True).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now())
    )

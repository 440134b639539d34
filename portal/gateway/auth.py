"""Who a request is for: a Caller is a tenant and, on /v1, the API key it came with (the
playground's callers are a session's tenant with no key), and the models that caller may use."""

from __future__ import annotations

from dataclasses import dataclass

from django.utils import timezone

from portal.core.db import db_sync_to_async
from portal.gateway import cache, observe
from portal.gateway.errors import invalid_api_key, missing_api_key, tenant_suspended
from portal.keys.hashing import hash_key, looks_like_key
from portal.keys.models import ApiKey
from portal.keys.selectors import api_key_authenticate, api_key_refusal_reason
from portal.keys.services import LAST_USED_RESOLUTION, api_key_record_use
from portal.tenants.models import Tenant


@dataclass(frozen=True)
class Caller:
    """Who a request is for: a tenant, through one of its API keys or (no key) its session."""

    tenant: Tenant
    api_key: ApiKey | None = None

    @classmethod
    def of_key(cls, api_key: ApiKey) -> Caller:
        return cls(api_key.tenant, api_key)


def model_allowed(caller: Caller, public_id: str) -> bool:
    """The key's allow-list: no key or None allows everything; `tenant/name` allows all its versions."""
    allowed = caller.api_key.allowed_models if caller.api_key is not None else None
    if allowed is None:
        return True
    return public_id in allowed or public_id.split("@", 1)[0] in allowed


def _authenticate(plaintext: str) -> ApiKey:
    api_key = api_key_authenticate(plaintext)
    if api_key is None:
        raise invalid_api_key(api_key_refusal_reason(plaintext))
    if api_key.tenant.is_active:
        api_key_record_use(api_key=api_key)
    return api_key


def _still_usable(api_key: ApiKey, digest: str) -> bool:
    """What api_key_authenticate's query checks that time alone can change: expiry, and the
    grace period of a rotated-out secret (revocation and rotation are writes: they invalidate)."""
    now = timezone.now()
    if not api_key.is_usable(now):
        return False
    return digest == api_key.secret_hash or (
        api_key.previous_valid_until is not None and api_key.previous_valid_until > now)


async def _cached_key(token: str) -> ApiKey:
    """The usable key with this secret: from the cache when it was read under this generation."""
    generation = await cache.generation()
    digest = hash_key(token) if looks_like_key(token) else None
    api_key = cache.API_KEYS.get(digest, generation) if digest is not None else cache.MISSING
    if api_key is not cache.MISSING and _still_usable(api_key, digest):
        last = api_key.last_used_at
        if api_key.tenant.is_active and (last is None or timezone.now() - last >= LAST_USED_RESOLUTION):
            await db_sync_to_async(api_key_record_use)(api_key=api_key)
        return api_key
    api_key = await db_sync_to_async(_authenticate)(token)
    if digest is not None:
        cache.API_KEYS.put(digest, api_key, generation)
    return api_key


async def api_key_from_authorization(authorization: str | None) -> ApiKey:
    """The usable key named by an `Authorization: Bearer sk-...` header value (401
    invalid_api_key, 403 tenant_suspended)."""
    if not authorization or not authorization.strip():
        raise missing_api_key()
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise invalid_api_key()
    api_key = await _cached_key(token)
    observe.tenant_authenticated(api_key.tenant.slug)
    if not api_key.tenant.is_active:
        raise tenant_suspended(api_key.tenant.slug)
    return api_key

"""Which model a request names: the fleet's base model, or one of the caller's tenant's ready
adapter versions (`tenant/name` through the adapter's deployment, `tenant/name@vN` pinned);
and what /v1/models lists for a caller. Another tenant's adapter is as unknown as a missing one."""

from __future__ import annotations

import time
from dataclasses import dataclass

from portal.adapters.models import AdapterVersion, Deployment
from portal.adapters.selectors import MODEL_ID, adapter_list_servable
from portal.adapters.traffic import pick_version as deployment_pick
from portal.core.db import db_sync_to_async
from portal.fleet.client import async_worker_client
from portal.fleet.selectors import base_model_first_seen, base_model_name, route_candidates
from portal.gateway import cache
from portal.gateway.auth import Caller, model_allowed
from portal.gateway.errors import model_not_found
from portal.tenants.models import Tenant

BASE_NAME_TTL = 10.0  # seconds a base name learnt from a worker's /v1/models is trusted


@dataclass(frozen=True)
class ModelTarget:
    public_id: str  # what the client asked for (and sees in every response)
    worker_model: str  # what the worker is asked for: the base name or the version's worker_name
    version: AdapterVersion | None  # None: the base model


# Before any poll has recorded a base model: (when learnt, name) asked of a worker directly.
_base_cache: dict[str, tuple[float, str]] = {}
# When this process first learnt each base name (unix seconds): the base's `created` in
# /v1/models when no worker row reports it yet. Never forgotten, so it stays the same.
_base_first_seen: dict[str, int] = {}


def base_model_forget() -> None:
    """Drop the base name learnt from a worker, and every cached row (the fleet changed under a
    test, say)."""
    _base_cache.clear()
    cache.forget_all()


async def base_model() -> str | None:
    """The fleet's base model name: from the polled workers, else asked of a worker directly."""
    name = await cache.fleet_cached("base_model_name", db_sync_to_async(base_model_name))
    if name:
        _base_first_seen.setdefault(name, int(time.time()))
        return name
    cached = _base_cache.get("base")
    if cached and time.monotonic() - cached[0] < BASE_NAME_TTL:
        return cached[1]
    client = async_worker_client()
    for target in await db_sync_to_async(route_candidates)(lora_name=None):
        name = await client.base_model_name(target.url)
        if name:
            _base_cache["base"] = (time.monotonic(), name)
            _base_first_seen.setdefault(name, int(time.time()))
            return name
    # No worker answers: the name learnt last, however old, still names the base, so a request
    # for it fails as the outage it is (503 no_worker_available), not as an unknown model (404).
    return cached[1] if cached else None


def _base_created(base: str) -> int:
    """The base's `created`: when the fleet first had a worker serving it, else when this
    process first learnt its name."""
    first = base_model_first_seen(base)
    if first is not None:
        return int(first.timestamp())
    return _base_first_seen.setdefault(base, int(time.time()))


def _adapter_choices(tenant: Tenant, model: str) -> tuple[list[AdapterVersion], dict | None]:
    """The ready versions `model` may resolve to (`@vN`: that one) and the deployment's weights:
    what portal.adapters.traffic.deployment_resolve reads, in its one query."""
    m = MODEL_ID.match(model)
    if m is None or m["tenant"] != tenant.slug:
        return [], None
    ready = AdapterVersion.objects.select_related("adapter__tenant", "adapter__deployment").filter(
        adapter__tenant=tenant, adapter__name=m["name"], status=AdapterVersion.Status.READY, retired_at__isnull=True)
    if m["number"]:
        ready = ready.filter(number=int(m["number"]))
    ready = list(ready)
    try:
        weights = ready[0].adapter.deployment.weights if ready else None
    except Deployment.DoesNotExist:
        weights = None
    return ready, weights


async def _adapter_version(caller: Caller, model: str, request_id: str) -> AdapterVersion | None:
    """deployment_resolve's answer, its rows cached (portal.gateway.cache) and the traffic split
    still picked per request id."""
    generation = await cache.generation()
    key = (caller.tenant.pk, caller.tenant.slug, model)
    choices = cache.ADAPTER_MODELS.get(key, generation)
    if choices is cache.MISSING:
        choices = await db_sync_to_async(_adapter_choices)(caller.tenant, model)
        cache.ADAPTER_MODELS.put(key, choices, generation)
    ready, weights = choices
    if not ready:
        return None
    if MODEL_ID.match(model)["number"]:
        return ready[0]
    return deployment_pick(ready, weights, request_id)


async def model_resolve(*, caller: Caller, model: str, request_id: str = "") -> ModelTarget:
    """The base model or one of the caller's tenant's ready adapter versions; 404 otherwise.
    A deployment's traffic split is picked deterministically from the request id."""
    if "/" in model:
        version = await _adapter_version(caller, model, request_id)
        if version is None or not model_allowed(caller, model):
            raise model_not_found(model)
        return ModelTarget(model, version.worker_name, version)
    base = await base_model()
    if base is not None and model == base and model_allowed(caller, model):
        return ModelTarget(model, model, None)
    raise model_not_found(model)


def _models_list(caller: Caller, base: str | None) -> list[dict]:
    tenant = caller.tenant
    entries: list[dict] = []
    if base is not None:
        entries.append({"id": base, "object": "model", "created": _base_created(base), "owned_by": "system"})
    for adapter in adapter_list_servable(tenant=tenant).prefetch_related("versions"):
        created = int(adapter.created_at.timestamp())
        entries.append({"id": adapter.public_id, "object": "model", "created": created,
                        "owned_by": tenant.slug, "parent": base})
        for version in sorted(adapter.versions.all(), key=lambda v: v.number):
            if version.status == AdapterVersion.Status.READY:
                entries.append({"id": f"{adapter.public_id}@v{version.number}", "object": "model",
                                "created": int(version.created_at.timestamp()), "owned_by": tenant.slug,
                                "parent": base})
    return [entry for entry in entries if model_allowed(caller, entry["id"])]


async def models_list(*, caller: Caller) -> list[dict]:
    """/v1/models for this caller: the base, then each servable adapter and its ready versions."""
    return await db_sync_to_async(_models_list)(caller, await base_model())

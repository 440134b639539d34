"""Deployments: which version `tenant/name` serves (weights, canary splits, rollback) and
whether the adapter is kept warm (pinned) on the workers.

    deployment_set_weights(adapter=, weights={3: 90, 4: 10}, actor=)   ready versions, weights >= 0,
        sum > 0; {} = the newest ready version. Audited; effective on the next request.
    deployment_pick_version(adapter=, request_id=) -> AdapterVersion | None
        deterministic per request id: sha256(request_id) mod total weight walks the weights in
        version order; no weights (or none of them ready) -> the newest ready version.
    deployment_resolve(tenant=, model=, request_id=) -> ResolvedAdapter | None
        what the gateway calls: `tenant/name@vN` pins vN, `tenant/name` picks by the weights.
    deployment_set_always_warm(adapter=, enabled=, actor=)   plan-gated
        (plan_for(tenant.plan).always_warm_adapters; over the limit -> LimitExceeded, a 403);
        after commit the deployed versions are staged and pinned on every worker, or unpinned.
"""

from __future__ import annotations

import hashlib
from functools import partial

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from portal.adapters import limits
from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment
from portal.adapters.selectors import MODEL_ID, ResolvedAdapter, adapter_version_resolve
from portal.core.exceptions import InvalidInput
from portal.tenants.models import Tenant
from portal.tenants.plans import plan_for

MAX_WEIGHT = 1_000_000


def _actor(actor):
    return actor if actor is not None and getattr(actor, "is_authenticated", False) else None


def _audit(*, adapter: Adapter, actor, action: str, details: dict) -> None:
    AuditEvent.objects.create(tenant=adapter.tenant, actor=_actor(actor), action=action, target=adapter.public_id,
                              details=details)


def _clean_weights(adapter: Adapter, weights: dict) -> dict[str, int]:
    if not isinstance(weights, dict):
        raise InvalidInput("weights", "expected an object {version number: weight}")
    ready = set(adapter.versions.filter(status=AdapterVersion.Status.READY).values_list("number", flat=True))
    clean: dict[int, int] = {}
    for key, weight in weights.items():
        try:
            number = int(str(key).lstrip("v"))
        except ValueError:
            raise InvalidInput("weights", f"{key!r} is not a version number") from None
        if number in clean:
            raise InvalidInput("weights", f"v{number} is given twice")
        if isinstance(weight, bool) or not isinstance(weight, int):
            raise InvalidInput("weights", f"v{number}: a weight must be an integer, got {weight!r}")
        if weight < 0 or weight > MAX_WEIGHT:
            raise InvalidInput("weights", f"v{number}: a weight must be between 0 and {MAX_WEIGHT}, got {weight}")
        if number not in ready:
            raise InvalidInput("weights", f"v{number} is not a ready version of {adapter.public_id}")
        clean[number] = weight
    if clean and sum(clean.values()) <= 0:
        raise InvalidInput("weights", "the weights must add up to more than 0")
    return {str(n): w for n, w in sorted(clean.items())}


def deployment_set_weights(*, adapter: Adapter, weights: dict[int, int], actor: AbstractBaseUser | None) -> Deployment:
    """Replace the deployment's weights ({} = newest ready version). Rollback is this call with
    the old version's weight; it takes effect on the next request."""
    with transaction.atomic():
        deployment = Deployment.objects.select_for_update().get_or_create(adapter=adapter)[0]
        clean = _clean_weights(adapter, weights)
        previous = dict(deployment.weights or {})
        deployment.weights = clean
        deployment.updated_by = _actor(actor)
        deployment.save()
        _audit(adapter=adapter, actor=actor, action="deployment.weights_set",
               details={"weights": clean, "previous": previous})
        if deployment.always_warm:
            transaction.on_commit(partial(_warm, adapter.pk, True))
    return deployment


def deployed_versions(*, adapter: Adapter) -> list[AdapterVersion]:
    """The ready versions the deployment sends traffic to (weight > 0, or the newest ready)."""
    ready = {v.number: v for v in adapter.versions.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True)}
    deployment = Deployment.objects.filter(adapter=adapter).first()
    weights = {int(n): int(w) for n, w in ((deployment.weights if deployment else None) or {}).items()}
    chosen = [ready[n] for n, w in sorted(weights.items()) if w > 0 and n in ready]
    if chosen:
        return chosen
    return [ready[max(ready)]] if ready else []


def request_bucket(request_id: str, total: int) -> int:
    """sha256(request_id) as an integer, mod total: the same request id always lands the same."""
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest(), "big") % total


def deployment_pick_version(*, adapter: Adapter, request_id: str) -> AdapterVersion | None:
    """The version this request is served by (see the module docstring); None: nothing ready."""
    ready = adapter.versions.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True) \
        .select_related("adapter__tenant")
    deployment = Deployment.objects.filter(adapter=adapter).only("weights").first()
    return _pick(list(ready), deployment.weights if deployment else None, request_id)


def _pick(ready_versions: list[AdapterVersion], weights: dict | None, request_id: str) -> AdapterVersion | None:
    ready = {v.number: v for v in ready_versions}
    if not ready:
        return None
    pairs = sorted((int(n), int(w)) for n, w in (weights or {}).items())
    pairs = [(n, w) for n, w in pairs if w > 0 and n in ready]
    total = sum(w for _, w in pairs)
    if total <= 0:
        return ready[max(ready)]
    bucket = request_bucket(request_id, total)
    for number, weight in pairs:
        if bucket < weight:
            return ready[number]
        bucket -= weight
    return ready[pairs[-1][0]]  # unreachable


def deployment_resolve(*, tenant: Tenant, model: str, request_id: str) -> ResolvedAdapter | None:
    """`tenant/name@vN` -> that ready version; `tenant/name` -> the deployment's pick (as
    deployment_pick_version); another tenant's or an unknown adapter -> None (like a missing
    one). One query on the request path: the ready versions with their adapter and deployment."""
    m = MODEL_ID.match(model)
    if m is None or m["tenant"] != tenant.slug:
        return None
    if m["number"]:
        return adapter_version_resolve(tenant=tenant, model=model)
    ready = list(AdapterVersion.objects.select_related("adapter__tenant", "adapter__deployment").filter(
        adapter__tenant=tenant, adapter__name=m["name"], status=AdapterVersion.Status.READY, retired_at__isnull=True))
    if not ready:
        return None
    try:
        weights = ready[0].adapter.deployment.weights
    except Deployment.DoesNotExist:
        weights = None
    version = _pick(ready, weights, request_id)
    return ResolvedAdapter(public_id=model, version=version) if version is not None else None


def deployment_set_always_warm(*, adapter: Adapter, enabled: bool, actor: AbstractBaseUser | None) -> Deployment:
    """Keep the adapter's deployed versions pinned on every worker (plan-gated), or stop."""
    with transaction.atomic():
        Tenant.objects.select_for_update().filter(pk=adapter.tenant_id).first()  # serialise the count
        deployment = Deployment.objects.select_for_update().get_or_create(adapter=adapter)[0]
        if enabled and not deployment.always_warm:
            allowed = plan_for(adapter.tenant.plan).always_warm_adapters
            used = Deployment.objects.filter(adapter__tenant_id=adapter.tenant_id, always_warm=True).count()
            if used >= allowed:
                raise limits.LimitExceeded(
                    "always_warm",
                    f"the {adapter.tenant.plan} plan allows {allowed} always-warm adapter{'s' * (allowed != 1)} "
                    f"and {adapter.tenant.slug} has {used}; turn one off or upgrade the plan",
                )
        if deployment.always_warm == enabled:
            return deployment
        deployment.always_warm = enabled
        deployment.updated_by = _actor(actor)
        deployment.save()
        _audit(adapter=adapter, actor=actor, action="deployment.always_warm_set", details={"always_warm": enabled})
        transaction.on_commit(partial(_warm, adapter.pk, enabled))
    return deployment


def _warm(adapter_id: int, enabled: bool) -> None:
    """After commit: stage the deployed versions (the stage task pins them when always-warm) and
    unpin the adapter's other versions; disabled: unpin them all."""
    from portal.adapters import staging

    adapter = Adapter.objects.select_related("tenant").filter(pk=adapter_id).first()
    if adapter is None:
        return
    deployed = deployed_versions(adapter=adapter) if enabled else []
    for version in deployed:
        staging.version_stage_enqueue(version=version)
    keep = {v.pk for v in deployed}
    others = [v for v in adapter.versions.filter(status=AdapterVersion.Status.READY) if v.pk not in keep]
    for url in staging.stage_targets():
        for version in others:
            staging.worker_pin(worker_url=url, lora_name=version.worker_name, pinned=False)

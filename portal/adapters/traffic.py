"""Which version serves a request: the deployment's weights read on the request path (the
gateway) and by staging, prewarm and the console. Reads only; writes are in deployments.py.

    deployment_pick_version(adapter=, request_id=) -> AdapterVersion | None
        deterministic per request id: sha256(request_id) mod total weight walks the weights in
        version order; no weights (or none of them ready) -> the newest ready version.
    deployment_resolve(tenant=, model=, request_id=) -> ResolvedAdapter | None
        what the gateway calls: `tenant/name@vN` pins vN, `tenant/name` picks by the weights.
    deployed_versions(adapter=) -> the versions the weights send traffic to.
    fleet_deployed_versions() -> every active tenant's deployed versions, in one query (what
        every worker should hold: portal.adapters.reconcile).
"""

from __future__ import annotations

import hashlib

from portal.adapters.models import Adapter, AdapterVersion, Deployment
from portal.adapters.selectors import MODEL_ID, ResolvedAdapter, adapter_version_resolve
from portal.tenants.models import Tenant


def deployed_versions(*, adapter: Adapter) -> list[AdapterVersion]:
    """The ready versions the deployment sends traffic to (weight > 0, or the newest ready)."""
    ready = list(adapter.versions.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True))
    deployment = Deployment.objects.filter(adapter=adapter).first()
    return _deployed(ready, deployment.weights if deployment else None)


def fleet_deployed_versions() -> list[AdapterVersion]:
    """Every deployed version of every active tenant's adapters (as deployed_versions, one
    query), with adapter, tenant and deployment selected."""
    rows = (AdapterVersion.objects.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True,
                                          adapter__tenant__status=Tenant.Status.ACTIVE)
            .select_related("adapter__tenant", "adapter__deployment").order_by("adapter_id", "number"))
    by_adapter: dict[int, list[AdapterVersion]] = {}
    for version in rows:
        by_adapter.setdefault(version.adapter_id, []).append(version)
    deployed = []
    for versions in by_adapter.values():
        try:
            weights = versions[0].adapter.deployment.weights
        except Deployment.DoesNotExist:
            weights = None
        deployed += _deployed(versions, weights)
    return deployed


def _deployed(ready_versions: list[AdapterVersion], weights: dict | None) -> list[AdapterVersion]:
    ready = {v.number: v for v in ready_versions}
    chosen = [ready[int(n)] for n, w in sorted((int(n), int(w)) for n, w in (weights or {}).items())
              if w > 0 and int(n) in ready]
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
    return pick_version(list(ready), deployment.weights if deployment else None, request_id)


def pick_version(ready_versions: list[AdapterVersion], weights: dict | None, request_id: str) -> AdapterVersion | None:
    """The deployment's split (`weights`: version number -> weight) over the ready versions, chosen
    by a hash of the request id; for callers holding the rows already (the gateway's cache)."""
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
    version = pick_version(ready, weights, request_id)
    return ResolvedAdapter(public_id=model, version=version) if version is not None else None

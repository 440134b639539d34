"""Reads: which adapter version a model id names, for a tenant."""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.db.models import QuerySet

from portal.adapters.models import Adapter, AdapterVersion
from portal.tenants.models import Tenant

# tenant-slug/adapter-name or tenant-slug/adapter-name@vN
MODEL_ID = re.compile(r"^(?P<tenant>[^/@\s]+)/(?P<name>[^/@\s]+)(?:@v(?P<number>[1-9][0-9]{0,8}))?$")


@dataclass(frozen=True)
class ResolvedAdapter:
    public_id: str  # what the client asked for, normalised (tenant/name or tenant/name@vN)
    version: AdapterVersion


def adapter_version_resolve(*, tenant: Tenant, model: str) -> ResolvedAdapter | None:
    """The ready version `model` names among `tenant`'s adapters, or None.

    `tenant/name@vN` pins version N; `tenant/name` takes the newest ready version (the
    deployment weights of the lifecycle work refine this). Another tenant's adapter resolves
    to None exactly like a missing one, so its existence never leaks."""
    m = MODEL_ID.match(model)
    if m is None or m["tenant"] != tenant.slug:
        return None
    versions = AdapterVersion.objects.select_related("adapter__tenant").filter(
        adapter__tenant=tenant, adapter__name=m["name"], status=AdapterVersion.Status.READY
    )
    if m["number"]:
        version = versions.filter(number=int(m["number"])).first()
    else:
        version = versions.order_by("-number").first()
    if version is None:
        return None
    return ResolvedAdapter(public_id=model, version=version)


def adapter_list_servable(*, tenant: Tenant) -> QuerySet[Adapter]:
    """The tenant's adapters with at least one ready version (what /v1/models lists)."""
    return (
        Adapter.objects.filter(tenant=tenant, versions__status=AdapterVersion.Status.READY)
        .select_related("tenant")
        .distinct()
        .order_by("name")
    )

"""Reads: which adapter version a model id names, for a tenant; adapters and versions for the API;
the base model's shapes that uploads are validated against."""

from __future__ import annotations

import re
from dataclasses import dataclass

from django.conf import settings
from django.db.models import QuerySet

from portal.adapters.models import Adapter, AdapterVersion, AuditEvent
from portal.adapters.validation import SMOLLM2_135M
from portal.fleet.selectors import base_model_config
from portal.tenants.models import Tenant
from protocol.adapter_format import BaseShapes

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
    to None exactly like a missing one, so its existence never leaks. Retired (and rejected,
    still validating) versions never resolve."""
    m = MODEL_ID.match(model)
    if m is None or m["tenant"] != tenant.slug:
        return None
    versions = AdapterVersion.objects.select_related("adapter__tenant").filter(
        adapter__tenant=tenant, adapter__name=m["name"], status=AdapterVersion.Status.READY, retired_at__isnull=True
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
        Adapter.objects.filter(
            tenant=tenant, versions__status=AdapterVersion.Status.READY, versions__retired_at__isnull=True
        )
        .select_related("tenant")
        .distinct()
        .order_by("name")
    )


def adapter_list(*, tenant: Tenant) -> QuerySet[Adapter]:
    return Adapter.objects.filter(tenant=tenant).select_related("tenant", "deployment").order_by("name")


def adapter_get(*, tenant: Tenant, name: str) -> Adapter | None:
    return adapter_list(tenant=tenant).filter(name=name).first()


def adapter_version_list(*, adapter: Adapter) -> QuerySet[AdapterVersion]:
    return adapter.versions.select_related("adapter__tenant", "created_by").order_by("-number")


def adapter_version_get(*, adapter: Adapter, number: int) -> AdapterVersion | None:
    return adapter_version_list(adapter=adapter).filter(number=number).first()


def audit_event_list(*, tenant: Tenant) -> QuerySet[AuditEvent]:
    return AuditEvent.objects.filter(tenant=tenant).select_related("actor").order_by("-created_at", "-id")


def base_shapes_current() -> BaseShapes:
    """The shapes uploads are validated against: the fleet's base model as its workers describe
    it (GET /v1/base_model, polled into InferenceWorker.base_config), else the default
    SmolLM2-135M-Instruct with max rank settings.ADAPTER_MAX_LORA_RANK (16 by default)."""
    max_rank = int(settings.ADAPTER_MAX_LORA_RANK)
    shapes = BaseShapes.from_config(base_model_config(), default_max_rank=max_rank)
    if shapes is not None:
        return shapes
    return BaseShapes(**{**SMOLLM2_135M.__dict__, "max_lora_rank": max_rank})

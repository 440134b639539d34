"""What a tenant may store: adapters per plan, bytes per plan, bytes per upload.

The plan table lives here rather than in portal/tenants/plans.py because only the adapter
lifecycle reads it. None means unlimited, as in plans.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.db.models import Sum

from portal.adapters.models import Adapter, AdapterVersion
from portal.core.exceptions import InvalidInput
from portal.tenants.models import Tenant

GIB = 1024**3

# Versions whose files are (or are about to be) in storage; rejected and retired versions
# have had theirs deleted, so they no longer count.
STORED_STATUSES = (
    AdapterVersion.Status.UPLOADED,
    AdapterVersion.Status.VALIDATING,
    AdapterVersion.Status.READY,
)


@dataclass(frozen=True)
class AdapterLimits:
    max_adapters: int | None
    max_storage_bytes: int | None


PLAN_LIMITS: dict[str, AdapterLimits] = {
    "free": AdapterLimits(max_adapters=5, max_storage_bytes=2 * GIB),
    "team": AdapterLimits(max_adapters=100, max_storage_bytes=50 * GIB),
    "enterprise": AdapterLimits(max_adapters=None, max_storage_bytes=None),
}


class LimitExceeded(InvalidInput):
    """Over a plan or upload limit: a 4xx with `status_code` (413 for bytes, 403 for counts)."""

    def __init__(self, field: str, message: str, *, status_code: int = 403):
        super().__init__(field, message)
        self.status_code = status_code


def limits_for(plan: str) -> AdapterLimits:
    """The limits of plan `plan`; unknown names get the free plan's, like plans.plan_for."""
    return PLAN_LIMITS.get(plan, PLAN_LIMITS["free"])


def max_upload_bytes() -> int:
    return int(settings.MAX_UPLOAD_BYTES)


def max_extracted_bytes() -> int:
    """The most an archive may unpack to (declared and actual): twice the upload limit by default
    (ADAPTER_MAX_EXTRACTED_BYTES)."""
    return int(settings.ADAPTER_MAX_EXTRACTED_BYTES)


def max_archive_files() -> int:
    """The most entries an archive may hold (a PEFT directory has two files and a README)."""
    return int(settings.ADAPTER_MAX_ARCHIVE_FILES)


def tenant_storage_used(*, tenant: Tenant) -> int:
    """Bytes of adapter files the tenant has in storage."""
    total = AdapterVersion.objects.filter(adapter__tenant=tenant, status__in=STORED_STATUSES).aggregate(
        total=Sum("size_bytes")
    )["total"]
    return int(total or 0)


def check_adapter_count(*, tenant: Tenant) -> None:
    limit = limits_for(tenant.plan).max_adapters
    if limit is not None and Adapter.objects.filter(tenant=tenant).count() >= limit:
        raise LimitExceeded(
            "name",
            f"the {tenant.plan} plan allows {limit} adapters and {tenant.slug} has {limit}; "
            "delete one or upgrade the plan",
        )


def check_upload_size(*, size: int) -> None:
    limit = max_upload_bytes()
    if size > limit:
        raise LimitExceeded(
            "files", f"the upload is {size} bytes; the limit is {limit} bytes", status_code=413
        )


def check_storage(*, tenant: Tenant, incoming: int) -> None:
    limit = limits_for(tenant.plan).max_storage_bytes
    if limit is None:
        return
    used = tenant_storage_used(tenant=tenant)
    if used + incoming > limit:
        raise LimitExceeded(
            "files",
            f"{tenant.slug} stores {used} bytes of adapters; adding {incoming} bytes would exceed the "
            f"{tenant.plan} plan's {limit} bytes. Retire old versions or upgrade the plan",
            status_code=413,
        )

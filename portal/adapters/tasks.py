"""Celery tasks of the adapter lifecycle (enqueued on commit by portal.adapters.services)."""

from celery import shared_task

from portal.adapters.services import adapter_version_validate


@shared_task(ignore_result=True, acks_late=True)
def adapter_version_validate_task(version_id: int) -> str | None:
    """Validate an uploaded version: status validating -> ready (then staged) or rejected.
    Safe to run twice; returns the final status, or None when there was nothing to do."""
    version = adapter_version_validate(version_id=version_id)
    return version.status if version is not None else None

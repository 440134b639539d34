"""Celery tasks of the adapters app: entry points like views, they take ids and call services.

Services start them by their registered names (portal.core.jobs), never by importing this
module. The staging and prewarm tasks keep the names they were registered under before they
moved here, so messages already queued on the broker still find them after a deploy.
"""

from celery import shared_task

from portal.adapters import prewarm, reconcile, staging
from portal.adapters.services import VALIDATE_TASK, adapter_version_validate


@shared_task(name=VALIDATE_TASK, ignore_result=True, acks_late=True)
def adapter_version_validate_task(version_id: int) -> str | None:
    """Validate an uploaded version: status validating -> ready (then staged) or rejected.
    Safe to run twice; returns the final status, or None when there was nothing to do."""
    version = adapter_version_validate(version_id=version_id)
    return version.status if version is not None else None


@shared_task(name=staging.STAGE_TASK, bind=True, ignore_result=True, acks_late=True,
             max_retries=staging.STAGE_MAX_RETRIES)
def version_stage_task(self, version_id: int, worker_url: str) -> str:
    """Load one version on one worker, retrying transient failures; returns the final status
    ("staged", "failed", "skipped" when the version is not ready). On a broker each retry is a
    new delivery after backoff_seconds(n); run eagerly (no Redis) the retries follow at once,
    so a dead worker cannot hold the caller for minutes."""
    retries = self.request.retries
    while True:
        status = staging.version_stage_once(version_id=version_id, worker_url=worker_url, attempts=retries + 1,
                                            final=retries >= self.max_retries)
        if status != staging.PENDING:
            return status
        countdown = staging.backoff_seconds(retries)
        if not self.request.is_eager:
            raise self.retry(countdown=countdown)
        retries += 1


@shared_task(name=staging.UNLOAD_TASK, bind=True, ignore_result=True, acks_late=True,
             max_retries=staging.STAGE_MAX_RETRIES)
def worker_unload_task(self, worker_url: str, lora_name: str) -> str:
    """Unload an adapter from a worker that could not be reached when its version was retired."""
    retries = self.request.retries
    while True:
        result = staging.worker_unload(worker_url, lora_name)
        if result in ("unloaded", "absent") or retries >= self.max_retries:
            return result
        if not self.request.is_eager:
            raise self.retry(countdown=staging.backoff_seconds(retries + 1))
        retries += 1


@shared_task(name=prewarm.PREWARM_TASK, ignore_result=True)
def prewarm_task() -> int:
    """Hourly: returns how many (worker, version) loads were enqueued."""
    return sum(len(names) for names in prewarm.prewarm().staged.values())


@shared_task(name=reconcile.RECONCILE_TASK, ignore_result=True)
def fleet_reconcile_task(worker_urls: list[str], came_up: list[str]) -> int:
    """After a fleet poll: stage the deployed versions these workers lack; returns how many
    (worker, version) loads were enqueued."""
    plan = reconcile.fleet_reconcile_urls(worker_urls=worker_urls, came_up=came_up)
    return sum(len(names) for names in plan.values())

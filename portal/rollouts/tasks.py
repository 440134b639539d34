"""Celery entry points for safe rollouts (thin: the work is in services)."""

from __future__ import annotations

import logging

from celery import shared_task

from portal.rollouts import selectors, services

log = logging.getLogger(__name__)


@shared_task(name="portal.rollouts.tasks.canary_guard_check_task", ignore_result=True)
def canary_guard_check_task() -> int:
    """Every minute (beat): judge every guarded deployment that has a canary. Returns rollbacks."""
    rolled_back = 0
    for deployment in selectors.guarded_deployments():
        if not selectors.deployment_roles(deployment=deployment)[1]:
            continue
        try:
            rolled_back += len(services.canary_guard_check(deployment_id=deployment.pk))
        except Exception:  # one deployment's failure must not starve the others
            log.exception("canary guard check of deployment %s failed", deployment.pk)
    return rolled_back

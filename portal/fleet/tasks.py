"""Celery tasks of the fleet: the periodic poll and the history's fold (beat entries added in
FleetConfig.ready)."""

from celery import shared_task
from django.utils import timezone

from portal.fleet.history import FOLD_EVERY_SECONDS, history_fold
from portal.fleet.services import fleet_poll

POLL_EVERY_SECONDS = 10.0


@shared_task(ignore_result=True)
def fleet_poll_task() -> int:
    """Poll every enabled worker; returns how many are healthy."""
    return sum(worker.healthy for worker in fleet_poll())


@shared_task(ignore_result=True)
def fleet_history_fold_task() -> dict[str, int]:
    """Fold the poll history into minute and hour rows and drop what is past its retention."""
    return history_fold(now=timezone.now())


BEAT_SCHEDULE = {
    "fleet-poll": {
        "task": "portal.fleet.tasks.fleet_poll_task",
        "schedule": POLL_EVERY_SECONDS,
        # A poll older than the next one is worthless: drop it rather than let a backlog
        # build up while no worker consumes the queue.
        "options": {"expires": POLL_EVERY_SECONDS},
    },
    "fleet-history-fold": {
        "task": "portal.fleet.tasks.fleet_history_fold_task",
        "schedule": FOLD_EVERY_SECONDS,
        # Each run folds everything not folded yet: a missed run is made up by the next one.
        "options": {"expires": FOLD_EVERY_SECONDS},
    },
}

"""Celery tasks of the fleet: the periodic poll (beat entry added in FleetConfig.ready)."""

from celery import shared_task

from portal.fleet.services import fleet_poll

POLL_EVERY_SECONDS = 10.0


@shared_task(ignore_result=True)
def fleet_poll_task() -> int:
    """Poll every enabled worker; returns how many are healthy."""
    return sum(worker.healthy for worker in fleet_poll())


BEAT_SCHEDULE = {
    "fleet-poll": {
        "task": "portal.fleet.tasks.fleet_poll_task",
        "schedule": POLL_EVERY_SECONDS,
        # A poll older than the next one is worthless: drop it rather than let a backlog
        # build up while no worker consumes the queue.
        "options": {"expires": POLL_EVERY_SECONDS},
    },
}

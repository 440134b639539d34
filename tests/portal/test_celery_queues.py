"""Celery's queues and time limits (portal/settings.py): the fleet poll alone on `fleet`, so a long
adapter validation never delays it; every task the platform registers has a queue and limits;
a plain `celery worker` (one box) consumes every queue."""

from __future__ import annotations

from django.conf import settings

from portal.celery import app

FLEET_QUEUE = {"portal.fleet.tasks.fleet_poll_task"}


def platform_tasks() -> set[str]:
    app.loader.import_default_modules()
    return {name for name in app.tasks if name.startswith("portal.")}


def routed_queue(name: str) -> str:
    """Where a message for `name` goes, through Celery's own router."""
    return app.amqp.router.route({}, name)["queue"].name


def test_every_platform_task_has_a_queue_and_both_time_limits():
    tasks = platform_tasks()
    assert tasks >= FLEET_QUEUE | {"portal.adapters.reconcile.fleet_reconcile_task"}
    for name in tasks:
        assert name in settings.CELERY_TASK_ROUTES, f"{name} has no queue of its own"
        limits = settings.CELERY_TASK_ANNOTATIONS[name]
        assert 0 < limits["soft_time_limit"] < limits["time_limit"], name


def test_only_the_poll_is_on_the_fleet_queue_and_validation_is_not_beside_it():
    queues = {name: routed_queue(name) for name in platform_tasks()}
    assert {name for name, queue in queues.items() if queue == "fleet"} == FLEET_QUEUE
    assert queues["portal.adapters.tasks.adapter_version_validate_task"] == "adapters"
    assert queues["portal.adapters.staging.version_stage_task"] == "adapters"
    # The poll must end well before the next one is due (every 10 s; its entry expires then).
    assert settings.CELERY_TASK_ANNOTATIONS["portal.fleet.tasks.fleet_poll_task"]["time_limit"] <= 30


def test_a_worker_without_queue_flags_consumes_every_queue():
    declared = {queue.name for queue in app.conf.task_queues}
    assert declared == {queue for queue in map(routed_queue, platform_tasks())} | {app.conf.task_default_queue}

"""Start a Celery task by its registered name, from a service.

Each app's tasks module is an entry point above its services: a task takes ids and calls a
service. A service that must start a task (validate an upload once it is stored, stage a version
once it is ready) therefore names the task instead of importing the module that imports the
service. A signature by name resolves to the registered task object (each app's ready() imports
its tasks module), so it honours task_always_eager exactly as `task.delay` does: in-process
without Redis, on the broker with it.
"""

from __future__ import annotations

from functools import partial

from celery import current_app
from django.db import transaction


def enqueue(task_name: str, *args, countdown: float | None = None, expires: float | None = None) -> None:
    """Send `task_name(*args)` now (after `countdown` seconds on a broker; dropped unstarted after
    `expires` seconds, for work the next periodic run redoes anyway)."""
    options = {key: value for key, value in (("countdown", countdown), ("expires", expires)) if value is not None}
    current_app.signature(task_name, args=args).apply_async(**options)


def enqueue_on_commit(task_name: str, *args) -> None:
    """Send it once the current transaction commits (the task must find the rows it is given)."""
    transaction.on_commit(partial(enqueue, task_name, *args))

"""`manage.py run_schedule`: Celery beat's periodic tasks (fleet poll, usage roll-ups, adapter
prewarm) for an install without a broker.

With REDIS_URL set, `celery worker --beat` runs them. Without it tasks run in-process and
there is no beat, so nothing would ever poll the workers (the fleet dashboard would stay empty
and routing would never learn residency). `make run` starts this command instead: one process
that runs each entry of the app's beat_schedule in-process when it is due.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime

from celery.schedules import maybe_schedule
from django.core.management.base import BaseCommand
from django.db import close_old_connections

from portal.celery import app

logger = logging.getLogger(__name__)


@dataclass
class Entry:
    name: str
    task: str
    schedule: object  # a celery schedule: interval or crontab
    last_run_at: datetime


class Schedule:
    """The app's beat schedule, run in this process with beat's timing: an interval entry first
    runs one interval after start (the workers `make run` starts with it are still loading),
    a crontab entry at its next time."""

    def __init__(self, app) -> None:
        self.app = app
        # What a Celery worker does at start: import every installed app's tasks module
        # (autodiscovery is lazy), or only the tasks something else happened to import are found.
        app.autodiscover_tasks(force=True)
        start = app.now()
        self.entries = []
        for name, spec in sorted((app.conf.beat_schedule or {}).items()):
            schedule = maybe_schedule(spec["schedule"], app=app)
            self.entries.append(Entry(name=name, task=spec["task"], schedule=schedule, last_run_at=start))

    def tick(self) -> float:
        """Run every due entry (a failure is logged, the others still run); returns seconds
        until the next one is due."""
        wait = []
        for entry in self.entries:
            due, next_in = entry.schedule.is_due(entry.last_run_at)
            if due:
                entry.last_run_at = self.app.now()
                self._run(entry)
                due, next_in = entry.schedule.is_due(entry.last_run_at)
            wait.append(next_in)
        return max(min(wait, default=60.0), 0.1)

    def run_all(self) -> None:
        for entry in self.entries:
            entry.last_run_at = self.app.now()
            self._run(entry)

    def _run(self, entry: Entry) -> None:
        task = self.app.tasks.get(entry.task)
        if task is None:
            logger.error("schedule: %s: no task named %s", entry.name, entry.task)
            return
        started = time.monotonic()
        # As a Celery worker does around each task: a connection the database dropped while
        # this process slept is replaced rather than failing the task.
        close_old_connections()
        try:
            result = task.apply(throw=False)  # in this process, whatever task_always_eager says
        finally:
            close_old_connections()
        if result.failed():
            logger.error("schedule: %s failed: %r", entry.name, result.result)
        else:
            logger.debug("schedule: %s done in %.2fs", entry.name, time.monotonic() - started)


class Command(BaseCommand):
    help = "Run the periodic tasks (fleet poll, usage roll-ups, prewarm) in-process, for installs without Celery beat."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="run every entry once now, then exit")

    def handle(self, *args, once: bool = False, **options):
        # Celery's per-task "succeeded in" line every 10 s says nothing a failure log would not.
        logging.getLogger("celery.app.trace").setLevel(logging.WARNING)
        schedule = Schedule(app)
        names = ", ".join(f"{e.name} ({e.task})" for e in schedule.entries) or "nothing"
        self.stdout.write(f"run_schedule: {names}")
        if once:
            schedule.run_all()
            return
        while True:
            time.sleep(min(schedule.tick(), 60.0))

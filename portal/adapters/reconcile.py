"""Every worker holds every deployed adapter: after each fleet poll, stage what a worker lacks.

A worker that restarts, a new pod the DNS discovery found, one back from an outage: each comes up
with no adapter registered. Nobody has to ask: on portal.fleet.signals.fleet_polled, for every
healthy worker whose whole adapter list the poll read (GET /v1/adapters, "disk" tier included),
a reconcile task goes to the `adapters` queue (the poll itself stays short: it runs every 10 s on
a queue of its own), and there the deployed versions (portal.adapters.traffic.fleet_deployed_versions) it does not have are
staged on it (portal.adapters.staging: fetch, load, and pin where the adapter is always-warm),
always-warm adapters first, at most RECONCILE_BATCH per worker per poll (the next poll goes on
with the rest, so a fleet of thousands of adapters refills a new worker without flooding it).

What is skipped, so that a poll every 10 s does not pile up work:
- a version already pending on that worker whose last attempt is recent (a task is on it);
- a version whose staging failed on that worker (the worker refused it: invalid, too large),
  unless the worker has just come up (it may be a different worker now, or fixed).
Workers whose adapter list could not be read (wrong admin token) are left alone: what they hold
is unknown, and the fleet page shows why.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.utils import timezone
from django.utils.dateparse import parse_datetime

from portal.adapters import staging
from portal.adapters.models import AdapterVersion, Deployment
from portal.adapters.traffic import fleet_deployed_versions
from portal.core.jobs import enqueue
from portal.fleet.models import InferenceWorker

logger = logging.getLogger(__name__)

# The task that runs fleet_reconcile (portal.adapters.tasks), by its registered name.
RECONCILE_TASK = "portal.adapters.reconcile.fleet_reconcile_task"
# A reconcile not started by then is dropped: later polls send fresh ones (a backlog on the
# adapters queue must not pile up stale copies).
RECONCILE_EXPIRES_SECONDS = 60.0
RECONCILE_BATCH = 128
# A pending entry older than this lost its task (a Celery worker died with it): stage again.
# The stage task's own retries (5, backing off from ADAPTER_STAGE_RETRY_SECONDS) end well before.
PENDING_STALE_AFTER = timedelta(minutes=15)


def on_fleet_polled(sender, *, workers: list[InferenceWorker], came_up: set[str], listed: set[str],
                    **kwargs) -> None:
    """The fleet_polled receiver (connected in AdaptersConfig.ready): one reconcile task for the
    healthy workers whose adapter list was read."""
    targets = sorted(w.url for w in workers if w.healthy and w.enabled and w.url in listed)
    if targets:
        enqueue(RECONCILE_TASK, targets, sorted(set(targets) & set(came_up)), expires=RECONCILE_EXPIRES_SECONDS)


def fleet_reconcile_urls(*, worker_urls: list[str], came_up: list[str]) -> dict[str, list[str]]:
    """The task's body: reconcile these workers as their rows are now (still healthy, enabled
    and present; their adapter lists as the last poll wrote them)."""
    workers = list(InferenceWorker.objects.filter(url__in=worker_urls, healthy=True, enabled=True,
                                                  gone_since__isnull=True))
    return fleet_reconcile(workers=workers, came_up=set(came_up)) if workers else {}


def fleet_reconcile(*, workers: list[InferenceWorker], came_up: set[str] = frozenset(),
                    now: datetime | None = None) -> dict[str, list[str]]:
    """Stage the deployed versions each worker lacks; returns {worker url: worker names enqueued}."""
    now = now or timezone.now()
    warm = set(Deployment.objects.filter(always_warm=True).values_list("adapter_id", flat=True))
    deployed = sorted(fleet_deployed_versions(), key=lambda v: (v.adapter_id not in warm, -v.pk))
    enqueued: dict[str, list[str]] = {}
    for worker in workers:
        registered = set(worker.resident_adapters or {})
        wanted = [v for v in deployed
                  if v.worker_name not in registered and _should_stage(v, worker.url, came_up=worker.url in came_up,
                                                                       now=now)]
        for version in wanted[:RECONCILE_BATCH]:
            if staging.version_stage_enqueue(version=version, worker_urls=[worker.url]):
                enqueued.setdefault(worker.url, []).append(version.worker_name)
        if worker.url in enqueued:
            logger.info("reconcile: staging %d of %d missing deployed adapter(s) on %s%s",
                        len(enqueued[worker.url]), len(wanted), worker.url,
                        " (it just came up)" if worker.url in came_up else "")
    return enqueued


def _should_stage(version: AdapterVersion, url: str, *, came_up: bool, now: datetime) -> bool:
    entry = (version.staging or {}).get(url) or {}
    status = entry.get("status")
    if status == staging.FAILED:
        return came_up
    if status == staging.PENDING:
        at = parse_datetime(entry.get("at") or "")
        return at is None or now - at > PENDING_STALE_AFTER
    return True

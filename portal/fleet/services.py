"""Writes on the fleet: worker rows from settings, and polling each worker's state.

A poll is two halves: portal.fleet.probe reads a worker over HTTP (the worker client; no ORM,
safe on any thread, never raises) and `_record` writes what it saw onto the row. fleet_poll
probes all workers at once on a small thread pool, so one hanging worker costs the others
nothing, then writes serially.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.fleet.client import POLL_TIMEOUT, WorkerClient
from portal.fleet.models import InferenceWorker, normalize_worker_url
from portal.fleet.probe import Probe, probe_worker

logger = logging.getLogger(__name__)

MAX_PARALLEL_PROBES = 16


# ---------------------------------------------------------------------------------- rows


@transaction.atomic
def fleet_sync_from_settings() -> list[InferenceWorker]:
    """Make sure every URL in settings.INFERENCE_URLS has a row (new rows enabled, not yet
    healthy); returns those rows. Rows added in the admin, or disabled there, are left alone."""
    urls = [normalize_worker_url(url) for url in settings.INFERENCE_URLS]
    existing = set(InferenceWorker.objects.filter(url__in=urls).values_list("url", flat=True))
    missing = [InferenceWorker(url=url, name=_default_name(url)) for url in urls if url not in existing]
    if missing:
        InferenceWorker.objects.bulk_create(missing, ignore_conflicts=True)
        logger.info("fleet: added workers from settings: %s", ", ".join(w.url for w in missing))
    by_url = {w.url: w for w in InferenceWorker.objects.filter(url__in=urls)}
    return [by_url[url] for url in urls if url in by_url]


def _default_name(url: str) -> str:
    return url.split("://", 1)[1]


# --------------------------------------------------------------------------------- polls


def worker_poll(*, worker: InferenceWorker, timeout: httpx.Timeout | float = POLL_TIMEOUT) -> InferenceWorker:
    """Poll one worker (portal.fleet.probe: /ready, /v1/models, /metrics, ...) and record what it
    saw on the row. Never raises for the worker's sake: a failure marks it unhealthy with
    last_error saying which request failed and how."""
    with WorkerClient(timeout=timeout) as client:
        probe = probe_worker(worker.url, client=client)
    return _record(worker=worker, probe=probe, now=timezone.now())


def fleet_poll(*, timeout: httpx.Timeout | float = POLL_TIMEOUT) -> list[InferenceWorker]:
    """Sync rows from settings, then poll every enabled worker (probes in parallel)."""
    fleet_sync_from_settings()
    workers = list(InferenceWorker.objects.filter(enabled=True))
    if not workers:
        return []
    with (WorkerClient(timeout=timeout) as client,
          ThreadPoolExecutor(min(MAX_PARALLEL_PROBES, len(workers))) as pool):
        probes = list(pool.map(lambda w: probe_worker(w.url, client=client), workers))
    now = timezone.now()
    return [_record(worker=w, probe=p, now=now) for w, p in zip(workers, probes, strict=True)]


def _record(*, worker: InferenceWorker, probe: Probe, now: datetime) -> InferenceWorker:
    if probe.healthy:
        fields = {
            "healthy": True,
            "base_model": probe.base_model,
            "last_seen_at": now,
            "last_error": probe.error,  # a warning (e.g. the adapter list was refused)
            "num_running": probe.num_running,
            "num_waiting": probe.num_waiting,
            "kv_cache_usage": probe.kv_cache_usage,
            "resident_adapters": probe.resident_adapters,
            "memory": probe.memory,
            "base_config": probe.base_config,
            "cache_stats": probe.cache_stats,
        }
    else:
        # Keep base_model (the last one known); forget load and residency: nothing is known.
        fields = {
            "healthy": False,
            "last_error": probe.error,
            "num_running": 0,
            "num_waiting": 0,
            "kv_cache_usage": 0.0,
            "resident_adapters": {},
            "memory": {},
            "cache_stats": {},
        }
    if worker.healthy != probe.healthy or (not probe.healthy and worker.last_error != probe.error):
        log = logger.info if probe.healthy else logger.warning
        log("fleet: worker %s is %s%s", worker.url, "healthy" if probe.healthy else "unhealthy",
            f": {probe.error}" if probe.error else "")
    fields.update(last_polled_at=now, updated_at=now)
    # update(), not save(): the admin may change name/enabled meanwhile; a deleted row stays deleted.
    InferenceWorker.objects.filter(pk=worker.pk).update(**fields)
    for name, value in fields.items():
        setattr(worker, name, value)
    return worker

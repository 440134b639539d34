"""Writes on the fleet: worker rows from settings and DNS discovery, and polling each worker.

A poll (fleet_poll, every 10 s on beat):
1. rows for settings.INFERENCE_URLS; then each settings.INFERENCE_DISCOVERY name is resolved
   (portal.fleet.discovery): a new address gets a row, an address the answer no longer lists is
   marked gone (not polled, not routed, deleted after FORGET_GONE_AFTER); a name that does not
   resolve keeps the rows it had (their own probes decide) and says why on its WorkerDiscovery row;
2. portal.fleet.probe reads every enabled, present worker over HTTP, all at once on a small
   thread pool (one hanging worker costs the others nothing; no ORM, never raises);
3. the base check: a worker whose base model (name and shapes) differs from the fleet's is
   recorded unhealthy with the reason, so it is never routed to;
4. `_record` writes what each probe saw onto its row, serially, and a WorkerEvent when the
   worker's state changed; then one bulk insert keeps a WorkerSample per worker (the history:
   portal.fleet.history);
5. signals.fleet_polled tells other apps (portal.adapters stages what a worker lacks).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.fleet.client import POLL_TIMEOUT, WorkerClient
from portal.fleet.discovery import Resolution, parse_discovery, resolve_workers
from portal.fleet.history import event_detail, sample_of, worker_condition
from portal.fleet.models import (
    BASE_MISMATCH,
    InferenceWorker,
    WorkerDiscovery,
    WorkerEvent,
    WorkerSample,
    normalize_worker_url,
)
from portal.fleet.probe import Probe, probe_worker
from portal.fleet.signals import fleet_polled

logger = logging.getLogger(__name__)

MAX_PARALLEL_PROBES = 16
# What a row says of a worker that is not serving (unreachable, mismatched, gone): no load, no
# residency, no counters (base_model is kept: the last one known).
NOTHING_KNOWN = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0, "resident_adapters": {}, "memory": {},
                 "cache_stats": {}}
# A discovered worker gone from its name's answer this long is a pod that will not come back
# (a new pod has a new address): its row goes, so rolling restarts do not pile up rows.
FORGET_GONE_AFTER = timedelta(hours=1)
# The base-model fields that must agree across the fleet (an adapter trained for one base is
# wrong on another); the served name alone is not enough: two workers may serve different
# checkpoints under one --served-model-name. Per-worker limits (max_loras, dtype) may differ.
BASE_IDENTITY_FIELDS = ("checkpoint_name", "num_hidden_layers", "hidden_size", "intermediate_size",
                        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


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


def fleet_sync_from_discovery(*, resolver=None, now: datetime | None = None) -> list[Resolution]:
    """Resolve every settings.INFERENCE_DISCOVERY name and bring the rows it found in line with
    its answer (see the module docstring). Returns the resolutions, in settings order."""
    now = now or timezone.now()
    specs = list(settings.INFERENCE_DISCOVERY)
    options = {"resolver": resolver} if resolver is not None else {}
    resolutions = [resolve_workers(parse_discovery(spec), **options) for spec in specs]
    for resolution in resolutions:
        _record_resolution(resolution, now=now)
        if resolution.ok:
            _sync_discovered(resolution, now=now)
    # Names taken out of the settings: their workers leave with them.
    _mark_gone(InferenceWorker.objects.exclude(discovered_by="").exclude(discovered_by__in=specs),
               reason="its discovery name is no longer configured", now=now)
    WorkerDiscovery.objects.exclude(spec__in=specs).delete()
    InferenceWorker.objects.filter(gone_since__lt=now - FORGET_GONE_AFTER).delete()
    return resolutions


def _record_resolution(resolution: Resolution, *, now: datetime) -> None:
    row, _ = WorkerDiscovery.objects.get_or_create(spec=resolution.spec)
    if resolution.error and resolution.error != row.last_error:
        logger.warning("fleet: discovery %s failed: %s (its workers keep their rows)", resolution.spec,
                       resolution.error)
    elif resolution.ok and row.last_error:
        logger.info("fleet: discovery %s resolves again: %d worker(s)", resolution.spec, len(resolution.urls))
    fields = {"last_error": resolution.error, "resolved_at": now}
    if resolution.ok:
        fields.update(addresses=list(resolution.urls), last_ok_at=now)
    WorkerDiscovery.objects.filter(pk=row.pk).update(**fields)


@transaction.atomic
def _sync_discovered(resolution: Resolution, *, now: datetime) -> None:
    spec, urls = resolution.spec, set(resolution.urls)
    known = set(InferenceWorker.objects.filter(url__in=urls).values_list("url", flat=True))
    new = [InferenceWorker(url=url, name=_default_name(url), discovered_by=spec) for url in sorted(urls - known)]
    if new:
        InferenceWorker.objects.bulk_create(new, ignore_conflicts=True)
        logger.info("fleet: %s found new workers: %s", spec, ", ".join(w.url for w in new))
    back = InferenceWorker.objects.filter(discovered_by=spec, url__in=urls, gone_since__isnull=False)
    returning = list(back)
    if back.update(gone_since=None, updated_at=now):
        logger.info("fleet: %s lists workers again that had left it", spec)
        WorkerEvent.objects.bulk_create([
            WorkerEvent(worker_id=w.pk, worker_name=str(w), at=now, kind=WorkerEvent.Kind.BACK,
                        detail=f"listed by {spec} again") for w in returning])
    _mark_gone(InferenceWorker.objects.filter(discovered_by=spec).exclude(url__in=urls),
               reason=f"left the answer of {spec}", now=now)


def _mark_gone(rows, *, reason: str, now: datetime) -> None:
    """Take discovered rows out of routing and polling at once (the pod is draining or gone)."""
    leaving = list(rows.filter(gone_since__isnull=True))
    if not leaving:
        return
    error = f"gone: {reason} at {now:%Y-%m-%d %H:%M:%S} UTC; not routed"
    rows.filter(pk__in=[w.pk for w in leaving]).update(
        gone_since=now, healthy=False, last_error=error, **NOTHING_KNOWN, updated_at=now)
    WorkerEvent.objects.bulk_create([
        WorkerEvent(worker_id=w.pk, worker_name=str(w), at=now, kind=WorkerEvent.Kind.GONE, detail=error)
        for w in leaving if w.enabled])
    logger.info("fleet: workers gone (%s): %s", reason, ", ".join(w.url for w in leaving))


# --------------------------------------------------------------------------------- polls


def worker_poll(*, worker: InferenceWorker, timeout: httpx.Timeout | float = POLL_TIMEOUT) -> InferenceWorker:
    """Poll one worker (portal.fleet.probe: /ready, /v1/models, /metrics, ...) and record what it
    saw on the row. Never raises for the worker's sake: a failure marks it unhealthy with
    last_error saying which request failed and how."""
    with WorkerClient(timeout=timeout) as client:
        probe = probe_worker(worker.url, client=client)
    now = timezone.now()
    worker = _record(worker=worker, probe=probe, now=now)
    if worker.enabled:  # a disabled worker polled from the admin serves nothing: not history
        WorkerSample.objects.bulk_create([sample_of(worker, now=now)])
    return worker


def fleet_poll(*, timeout: httpx.Timeout | float = POLL_TIMEOUT, resolver=None) -> list[InferenceWorker]:
    """Sync rows from settings and discovery, poll every enabled worker still present (probes
    in parallel), check they serve one base model, record, then send signals.fleet_polled."""
    fleet_sync_from_settings()
    fleet_sync_from_discovery(resolver=resolver)
    workers = list(InferenceWorker.objects.filter(enabled=True, gone_since__isnull=True))
    if not workers:
        return []
    with (WorkerClient(timeout=timeout) as client,
          ThreadPoolExecutor(min(MAX_PARALLEL_PROBES, len(workers))) as pool):
        probes = list(pool.map(lambda w: probe_worker(w.url, client=client), workers))
    probes = fleet_base_check(workers, probes)
    came_up = {w.url for w, p in zip(workers, probes, strict=True) if p.healthy and not w.healthy}
    listed = {w.url for w, p in zip(workers, probes, strict=True) if p.healthy and p.adapters_listed}
    now = timezone.now()
    rows = [_record(worker=w, probe=p, now=now) for w, p in zip(workers, probes, strict=True)]
    WorkerSample.objects.bulk_create([sample_of(w, now=now) for w in rows])
    fleet_polled.send(sender=InferenceWorker, workers=rows, came_up=came_up, listed=listed)
    return rows


def base_identity(base_model: str, base_config: dict | None) -> tuple:
    """What must agree for two workers to serve one base: the name and, when reported, shapes."""
    config = base_config or {}
    return (base_model, *(config.get(name) for name in BASE_IDENTITY_FIELDS))


def fleet_base_check(workers: list[InferenceWorker], probes: list[Probe]) -> list[Probe]:
    """The probes with every healthy worker whose base differs from the fleet's turned into an
    unhealthy one saying so. The fleet's base: the identity most healthy workers serve; on a tie
    the one the workers already routed to serve (a newcomer cannot take over a fleet of one),
    then the oldest row's."""
    seen = [(w, p, base_identity(p.base_model, p.base_config)) for w, p in zip(workers, probes, strict=True)
            if p.healthy]
    if len({identity for _, _, identity in seen}) <= 1:
        return probes
    votes = Counter(identity for _, _, identity in seen)
    incumbents = Counter(identity for w, _, identity in seen
                         if w.healthy and base_identity(w.base_model, w.base_config) == identity)
    oldest = {identity: min(w.created_at for w, _, i in seen if i == identity) for identity in votes}
    expected = max(votes, key=lambda i: (votes[i], incumbents[i], -oldest[i].timestamp()))
    checked = []
    for p in probes:
        if p.healthy and base_identity(p.base_model, p.base_config) != expected:
            reason = (f"{BASE_MISMATCH}: serves {_describe_base(p.base_model, p.base_config)}, the fleet serves "
                      f"{_describe_base(expected[0], dict(zip(BASE_IDENTITY_FIELDS, expected[1:], strict=True)))}; "
                      "not routed")
            p = Probe(healthy=False, error=reason, base_model=p.base_model)
        checked.append(p)
    return checked


def _describe_base(name: str, config: dict) -> str:
    shapes = [f"{field}={config[field]}" for field in BASE_IDENTITY_FIELDS if config.get(field) is not None]
    return f"{name!r}" + (f" ({', '.join(shapes)})" if shapes else "")


def _record(*, worker: InferenceWorker, probe: Probe, now: datetime) -> InferenceWorker:
    # The state before this poll; None for a row never polled (its first poll is an event).
    before = worker_condition(worker) if worker.last_polled_at is not None else None
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
        # Keep base_model (the last one known, or the one a mismatched worker reports); forget
        # load and residency: nothing is known, or the worker is not to be used.
        fields = {
            **({"base_model": probe.base_model} if probe.base_model else {}),
            "healthy": False,
            "last_error": probe.error,
            **NOTHING_KNOWN,
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
    after = worker_condition(worker)
    if after != before and after:
        WorkerEvent.objects.create(worker_id=worker.pk, worker_name=str(worker), at=now, kind=after,
                                   detail=event_detail(worker, after))
    return worker

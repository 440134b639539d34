"""Staging: preload a ready version into the host tier of every inference worker, and unload it.

    version_stage_enqueue(version=)   after commit, one Celery task per enabled worker
      version_stage_task(version_id, worker_url)   (portal.adapters.tasks) -> version_stage_once
        POST <worker>/v1/load_lora_adapter  portal.fleet.client.version_load_body(version=)
            source_path set  -> {lora_name, lora_path}                       (staff-registered)
            else             -> {lora_name, lora_url: PORTAL_INTERNAL_URL/internal/adapters/<uid>/,
                                 files: {filename: sha256}, auth_token: INFERENCE_ADMIN_TOKEN}
        then, when the adapter is always-warm and the version is deployed, POST .../pin
        transient failures (network, 5xx, the worker could not fetch) retry with exponential
        backoff (ADAPTER_STAGE_RETRY_SECONDS * 2**n, at most STAGE_MAX_RETRIES times); a worker
        rejecting the adapter (invalid, checksum, too large) fails at once
        status per worker in version.staging[worker_url] = {"status": pending|staged|failed,
            "attempts": n, "error": str, "at": iso, "pinned": bool}  (row-locked merges)
    version_unstage(version=)         unload_lora_adapter on every worker (404 = already gone);
                                      workers that could not be reached get a retrying task

Every call to a worker goes through portal.fleet.client (the admin token, timeouts, the
answers read). Settings read here: INFERENCE_URLS (when no worker row exists),
ADAPTER_STAGE_RETRY_SECONDS (default 2).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.adapters.models import AdapterVersion, Deployment
from portal.adapters.traffic import deployed_versions
from portal.core.jobs import enqueue, enqueue_on_commit
from portal.fleet.client import Reply, WorkerClient, version_load_body
from portal.fleet.models import InferenceWorker, normalize_worker_url
from protocol import worker_api

logger = logging.getLogger(__name__)

STAGE_MAX_RETRIES = 5
MAX_BACKOFF_SECONDS = 300.0
PENDING, STAGED, FAILED, SKIPPED = "pending", "staged", "failed", "skipped"
# The Celery tasks that run staging (portal.adapters.tasks), by their registered names: the
# tasks call this module, so it names them rather than importing them (portal.core.jobs).
STAGE_TASK = "portal.adapters.staging.version_stage_task"
UNLOAD_TASK = "portal.adapters.staging.worker_unload_task"
# Worker 400 codes that another try may fix (the worker could not reach or read the portal).
TRANSIENT_CODES = {worker_api.ADAPTER_FETCH_FAILED}


# --- which workers ----------------------------------------------------------------------------


def stage_targets() -> list[str]:
    """Worker URLs to stage on: every enabled worker row still present (healthy or not: a retry
    may find it up; a discovered one gone from DNS is not), or settings.INFERENCE_URLS minus
    disabled rows while no row exists."""
    rows = list(InferenceWorker.objects.values_list("url", "enabled", "gone_since"))
    enabled = [url for url, on, gone_since in rows if on and gone_since is None]
    if enabled or rows:
        return sorted(enabled)
    return sorted({normalize_worker_url(u) for u in settings.INFERENCE_URLS})


# --- staging ----------------------------------------------------------------------------------


def version_stage_enqueue(*, version: AdapterVersion, worker_urls: list[str] | None = None) -> list[str]:
    """Mark the version pending on each worker and enqueue one stage task per worker after
    commit. Only ready versions are staged; returns the worker URLs enqueued."""
    urls = stage_targets() if worker_urls is None else sorted(set(worker_urls))
    if not urls:
        return []
    with transaction.atomic():
        locked = AdapterVersion.objects.select_for_update().filter(pk=version.pk).first()
        if locked is None or locked.status != AdapterVersion.Status.READY:
            return []
        staging = dict(locked.staging or {})
        now = timezone.now().isoformat()
        for url in urls:
            staging[url] = {**staging.get(url, {}), "status": PENDING, "attempts": 0, "error": "", "at": now}
        locked.staging = staging
        locked.save(update_fields=["staging", "updated_at"])
        for url in urls:
            enqueue_on_commit(STAGE_TASK, locked.pk, url)
    return urls


def version_stage_once(*, version_id: int, worker_url: str, attempts: int, final: bool) -> str:
    """One load of the version on one worker, recorded in version.staging; returns STAGED,
    FAILED, SKIPPED (the version is not ready, or was retired while loading) or PENDING (a
    transient failure another try may fix; never when `final`). The stage task retries PENDING."""
    version = AdapterVersion.objects.select_related("adapter").filter(pk=version_id).first()
    if version is None or version.status != AdapterVersion.Status.READY:
        return SKIPPED
    error, transient = stage_on_worker(version=version, worker_url=worker_url)
    if error is None:
        if not _still_ready(version_id):  # retired while loading: take it back off
            worker_unload(worker_url, version.worker_name)
            return SKIPPED
        pinned, pin_error = _pin_if_warm(version, worker_url)
        _record(version_id, worker_url, status=STAGED, attempts=attempts, error=pin_error or "", pinned=pinned)
        return STAGED
    if not transient or final:
        _record(version_id, worker_url, status=FAILED, attempts=attempts, error=error)
        logger.warning("staging %s on %s failed after %d attempts: %s", version.worker_name, worker_url,
                       attempts, error)
        return FAILED
    _record(version_id, worker_url, status=PENDING, attempts=attempts, error=error)
    return PENDING


def backoff_seconds(retries: int) -> float:
    base = float(settings.ADAPTER_STAGE_RETRY_SECONDS)
    return min(MAX_BACKOFF_SECONDS, base * 2**retries)


def stage_on_worker(*, version: AdapterVersion, worker_url: str) -> tuple[str | None, bool]:
    """One load attempt: (None, False) when loaded, else (why, whether another try may help)."""
    with WorkerClient() as client:
        reply = client.load_adapter(worker_url, version_load_body(version=version))
    if reply.ok:
        return None, False
    return reply.describe(), _transient(reply)


def _transient(reply: Reply) -> bool:
    """No answer, the worker overloaded or failing, or it could not fetch from the portal."""
    if reply.status is None or reply.exception is not None:
        return True
    return reply.status >= 500 or reply.status == 429 or reply.error.code in TRANSIENT_CODES


def _pin_if_warm(version: AdapterVersion, worker_url: str) -> tuple[bool, str | None]:
    deployment = Deployment.objects.filter(adapter_id=version.adapter_id, always_warm=True).first()
    if deployment is None or version.pk not in {v.pk for v in deployed_versions(adapter=version.adapter)}:
        return False, None
    error = worker_pin(worker_url=worker_url, lora_name=version.worker_name, pinned=True)
    return error is None, (f"pin: {error}" if error else None)


def worker_pin(*, worker_url: str, lora_name: str, pinned: bool) -> str | None:
    """POST /v1/adapters/<name>/pin|unpin; None when done (or, unpinning, when not registered)."""
    with WorkerClient() as client:
        reply = client.pin_adapter(worker_url, lora_name, pinned=pinned)
    if reply.ok or (reply.status == 404 and reply.exception is None and not pinned):
        return None
    return reply.describe()


def _still_ready(version_id: int) -> bool:
    return AdapterVersion.objects.filter(pk=version_id, status=AdapterVersion.Status.READY).exists()


def _record(version_id: int, worker_url: str, **entry) -> None:
    """Merge one worker's entry into version.staging under a row lock (tasks for the other
    workers write the same JSON concurrently)."""
    with transaction.atomic():
        version = AdapterVersion.objects.select_for_update().filter(pk=version_id).first()
        if version is None:
            return
        staging = dict(version.staging or {})
        staging[worker_url] = {**staging.get(worker_url, {}), **entry, "at": timezone.now().isoformat()}
        version.staging = staging
        version.save(update_fields=["staging", "updated_at"])


# --- unstaging --------------------------------------------------------------------------------


def version_unstage(*, version: AdapterVersion) -> dict[str, str]:
    """Unload the version from every worker, in parallel; returns {worker_url: "unloaded" |
    "absent" | error}. Unreachable workers get a retrying Celery task. The version row may be
    gone already (adapter deleted): only its worker_name and staging map are used."""
    urls = sorted(set(stage_targets()) | set(version.staging or {}))
    if not urls:
        return {}
    name = version.worker_name
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        results = dict(zip(urls, pool.map(lambda url: worker_unload(url, name), urls), strict=True))
    for url, result in results.items():
        if result not in ("unloaded", "absent"):
            logger.warning("unloading %s from %s failed: %s; retrying in the background", name, url, result)
            enqueue(UNLOAD_TASK, url, name, countdown=backoff_seconds(0))
    return results


def worker_unload(worker_url: str, lora_name: str) -> str:
    with WorkerClient() as client:
        reply = client.unload_adapter(worker_url, lora_name)
    if reply.ok:
        return "unloaded"
    if reply.status == 404 and reply.exception is None:
        return "absent"
    return reply.describe()

"""Staging: preload a ready version into the host tier of every inference worker, and unload it.

    version_stage_enqueue(version=)   after commit, one Celery task per enabled worker
      version_stage_task(version_id, worker_url)
        POST <worker>/v1/load_lora_adapter  version_load_body(version=)
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

Settings read: INFERENCE_ADMIN_TOKEN, INFERENCE_URLS (when no worker row exists),
PORTAL_INTERNAL_URL (default http://127.0.0.1:8000: how workers reach this portal),
ADAPTER_STAGE_RETRY_SECONDS (default 2).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import httpx
from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from portal.adapters.models import AdapterVersion, Deployment
from portal.fleet.models import InferenceWorker, normalize_worker_url

logger = logging.getLogger(__name__)

STAGE_MAX_RETRIES = 5
MAX_BACKOFF_SECONDS = 300.0
LOAD_TIMEOUT = httpx.Timeout(300.0, connect=5.0)  # the worker fetches and validates before answering
ADMIN_TIMEOUT = httpx.Timeout(10.0, connect=3.0)
PENDING, STAGED, FAILED = "pending", "staged", "failed"
# Worker 400 codes that another try may fix (the worker could not reach or read the portal).
TRANSIENT_CODES = {"adapter_fetch_failed"}


# --- what the workers are told ---------------------------------------------------------------


def portal_internal_url() -> str:
    return str(getattr(settings, "PORTAL_INTERNAL_URL", None) or "http://127.0.0.1:8000").rstrip("/")


def version_load_body(*, version: AdapterVersion) -> dict:
    """The body of POST /v1/load_lora_adapter that loads this version on a worker (the gateway's
    lazy load uses it too)."""
    if version.source_path:
        return {"lora_name": version.worker_name, "lora_path": version.source_path}
    body = {
        "lora_name": version.worker_name,
        "lora_url": f"{portal_internal_url()}/internal/adapters/{version.uid}/",
        "files": dict(version.file_sha256 or {}),
    }
    token = getattr(settings, "INFERENCE_ADMIN_TOKEN", None)
    if token:
        body["auth_token"] = token
    return body


def admin_headers() -> dict[str, str]:
    token = getattr(settings, "INFERENCE_ADMIN_TOKEN", None)
    return {"authorization": f"Bearer {token}"} if token else {}


def stage_targets() -> list[str]:
    """Worker URLs to stage on: every enabled worker row (healthy or not: a retry may find it up),
    or settings.INFERENCE_URLS minus disabled rows while no row exists."""
    rows = list(InferenceWorker.objects.values_list("url", "enabled"))
    enabled = [url for url, on in rows if on]
    if enabled or rows:
        return sorted(enabled)
    return sorted({normalize_worker_url(u) for u in getattr(settings, "INFERENCE_URLS", [])})


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
            transaction.on_commit(partial(version_stage_task.delay, locked.pk, url))
    return urls


@shared_task(bind=True, ignore_result=True, acks_late=True, max_retries=STAGE_MAX_RETRIES)
def version_stage_task(self, version_id: int, worker_url: str) -> str:
    """Load one version on one worker (retrying transient failures); returns the final status
    ("staged", "failed", "skipped" when the version is not ready). On a broker each retry is a
    new delivery after backoff_seconds(n); run eagerly (no Redis) the retries follow at once,
    so a dead worker cannot hold the caller for minutes."""
    retries = self.request.retries
    while True:
        version = AdapterVersion.objects.select_related("adapter").filter(pk=version_id).first()
        if version is None or version.status != AdapterVersion.Status.READY:
            return "skipped"
        attempts = retries + 1
        error, transient = stage_on_worker(version=version, worker_url=worker_url)
        if error is None:
            if not _still_ready(version_id):  # retired while loading: take it back off
                _unload(worker_url, version.worker_name)
                return "skipped"
            pinned, pin_error = _pin_if_warm(version, worker_url)
            _record(version_id, worker_url, status=STAGED, attempts=attempts, error=pin_error or "", pinned=pinned)
            return STAGED
        if not transient or retries >= self.max_retries:
            _record(version_id, worker_url, status=FAILED, attempts=attempts, error=error)
            logger.warning("staging %s on %s failed after %d attempts: %s", version.worker_name, worker_url,
                           attempts, error)
            return FAILED
        _record(version_id, worker_url, status=PENDING, attempts=attempts, error=error)
        countdown = backoff_seconds(retries)
        if not self.request.is_eager:
            raise self.retry(countdown=countdown)
        retries += 1


def backoff_seconds(retries: int) -> float:
    base = float(getattr(settings, "ADAPTER_STAGE_RETRY_SECONDS", 2.0))
    return min(MAX_BACKOFF_SECONDS, base * 2**retries)


def stage_on_worker(*, version: AdapterVersion, worker_url: str) -> tuple[str | None, bool]:
    """One load attempt: (None, False) when loaded, else (why, whether another try may help)."""
    url = worker_url.rstrip("/")
    try:
        with _client(LOAD_TIMEOUT) as client:
            response = client.post(f"{url}/v1/load_lora_adapter", json=version_load_body(version=version),
                                   headers=admin_headers())
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}", True
    if response.status_code == 200:
        return None, False
    error = _error(response)
    message = f"HTTP {response.status_code}: {error.get('message') or response.text[:300]}"
    transient = response.status_code >= 500 or response.status_code == 429 or error.get("code") in TRANSIENT_CODES
    return message, transient


def _pin_if_warm(version: AdapterVersion, worker_url: str) -> tuple[bool, str | None]:
    from portal.adapters.deployments import deployed_versions

    deployment = Deployment.objects.filter(adapter_id=version.adapter_id, always_warm=True).first()
    if deployment is None or version.pk not in {v.pk for v in deployed_versions(adapter=version.adapter)}:
        return False, None
    error = worker_pin(worker_url=worker_url, lora_name=version.worker_name, pinned=True)
    return error is None, (f"pin: {error}" if error else None)


def worker_pin(*, worker_url: str, lora_name: str, pinned: bool) -> str | None:
    """POST /v1/adapters/<name>/pin|unpin; None when done (or, unpinning, when not registered)."""
    action = "pin" if pinned else "unpin"
    try:
        with _client(ADMIN_TIMEOUT) as client:
            response = client.post(f"{worker_url.rstrip('/')}/v1/adapters/{lora_name}/{action}",
                                   headers=admin_headers())
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code == 200 or (response.status_code == 404 and not pinned):
        return None
    return f"HTTP {response.status_code}: {_error(response).get('message') or response.text[:300]}"


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
        results = dict(zip(urls, pool.map(lambda url: _unload(url, name), urls), strict=True))
    for url, result in results.items():
        if result not in ("unloaded", "absent"):
            logger.warning("unloading %s from %s failed: %s; retrying in the background", name, url, result)
            worker_unload_task.apply_async((url, name), countdown=backoff_seconds(0))
    return results


@shared_task(bind=True, ignore_result=True, acks_late=True, max_retries=STAGE_MAX_RETRIES)
def worker_unload_task(self, worker_url: str, lora_name: str) -> str:
    retries = self.request.retries
    while True:
        result = _unload(worker_url, lora_name)
        if result in ("unloaded", "absent") or retries >= self.max_retries:
            return result
        if not self.request.is_eager:
            raise self.retry(countdown=backoff_seconds(retries + 1))
        retries += 1


def _unload(worker_url: str, lora_name: str) -> str:
    try:
        with _client(ADMIN_TIMEOUT) as client:
            response = client.post(f"{worker_url.rstrip('/')}/v1/unload_lora_adapter", json={"lora_name": lora_name},
                                   headers=admin_headers())
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if response.status_code == 200:
        return "unloaded"
    if response.status_code == 404:
        return "absent"
    return f"HTTP {response.status_code}: {_error(response).get('message') or response.text[:300]}"


# --- helpers ----------------------------------------------------------------------------------


def _client(timeout: httpx.Timeout) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False, follow_redirects=False)


def _error(response: httpx.Response) -> dict:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}

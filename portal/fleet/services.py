"""Writes on the fleet: worker rows from settings, and polling each worker's state.

A poll is two halves: `probe_worker` talks HTTP only (no ORM, safe on any thread, never
raises) and `_record` writes what it saw onto the row. fleet_poll probes all workers at once
on a small thread pool, so one hanging worker costs the others nothing, then writes serially.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from portal.fleet.models import InferenceWorker, normalize_worker_url

logger = logging.getLogger(__name__)

# Short: a poll runs every 10 s and a worker that takes seconds to answer /ready is in trouble.
POLL_TIMEOUT = httpx.Timeout(2.0, connect=1.0)
MAX_PARALLEL_PROBES = 16
ERROR_DETAIL_CHARS = 300

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
ADAPTER_RESIDENT = "loraplex:adapter_resident"  # {adapter, tier} 1.0 for the tier it is in
# The adapter cache's counters (family names; samples end in _total). Per tier: hits, evictions.
CACHE_COUNTERS = {
    "loraplex:lora_cache_hits": "hits",
    "loraplex:lora_cache_evictions": "evictions",
    "loraplex:lora_cache_misses": "misses",
    "loraplex:lora_cache_loads": "loads",
    "loraplex:lora_cache_load_failures": "load_failures",
}
PER_TIER = ("hits", "evictions")


class PollError(Exception):
    """One readable line saying which request failed and how."""


@dataclass
class Probe:
    """What one poll of a worker saw. healthy=False: `error` says why, the rest is empty."""

    healthy: bool
    error: str = ""
    base_model: str = ""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    resident_adapters: dict[str, str] = field(default_factory=dict)
    memory: dict[str, int | float] = field(default_factory=dict)
    base_config: dict = field(default_factory=dict)
    cache_stats: dict = field(default_factory=dict)


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
    """Poll one worker (GET /ready, /v1/models, /metrics, /v1/adapters) and record what it
    saw on the row. Never raises for the worker's sake: a failure marks it unhealthy with
    last_error saying which request failed and how."""
    with _client(timeout) as client:
        probe = probe_worker(worker.url, client=client, admin_token=settings.INFERENCE_ADMIN_TOKEN)
    return _record(worker=worker, probe=probe, now=timezone.now())


def fleet_poll(*, timeout: httpx.Timeout | float = POLL_TIMEOUT) -> list[InferenceWorker]:
    """Sync rows from settings, then poll every enabled worker (probes in parallel)."""
    fleet_sync_from_settings()
    workers = list(InferenceWorker.objects.filter(enabled=True))
    if not workers:
        return []
    token = settings.INFERENCE_ADMIN_TOKEN
    with _client(timeout) as client, ThreadPoolExecutor(min(MAX_PARALLEL_PROBES, len(workers))) as pool:
        probes = list(pool.map(lambda w: probe_worker(w.url, client=client, admin_token=token), workers))
    now = timezone.now()
    return [_record(worker=w, probe=p, now=now) for w, p in zip(workers, probes, strict=True)]


def _client(timeout: httpx.Timeout | float) -> httpx.Client:
    # trust_env=False: a worker on an internal address must never be reached through a proxy.
    return httpx.Client(timeout=timeout, trust_env=False, follow_redirects=False)


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


# ------------------------------------------------------------------------- HTTP, no ORM


def probe_worker(url: str, *, client: httpx.Client, admin_token: str | None = None) -> Probe:
    """Ask one worker how it is. Never raises; touches no database."""
    try:
        _check_ready(client, url)
        base_model, registered = _read_models(client, url)
        probe = _read_metrics(client, url)
        probe.base_model = base_model
        probe.base_config = _read_base_config(client, url)
        adapters, warning = _read_adapters(client, url, admin_token)
        if adapters is None:
            # Fall back to what needs no token: residency gauges in /metrics, else the names.
            adapters = probe.resident_adapters or {name: "registered" for name in registered}
        probe.resident_adapters = adapters
        probe.error = warning
        return probe
    except PollError as error:
        return Probe(healthy=False, error=str(error))
    except Exception as error:  # a worker must never break the poll of the others
        logger.exception("fleet: unexpected failure polling %s", url)
        return Probe(healthy=False, error=f"unexpected {type(error).__name__}: {error}"[:ERROR_DETAIL_CHARS])


def _get(client: httpx.Client, url: str, path: str, *, headers: dict | None = None) -> httpx.Response:
    try:
        response = client.get(f"{url}{path}", headers=headers)
    except httpx.TimeoutException as error:
        raise PollError(f"GET {path}: timed out ({type(error).__name__})") from None
    except httpx.ConnectError as error:
        raise PollError(f"GET {path}: cannot connect: {error or 'connection failed'}") from None
    except httpx.HTTPError as error:
        raise PollError(f"GET {path}: {type(error).__name__}: {error}") from None
    if response.status_code != 200:
        raise PollError(f"GET {path}: HTTP {response.status_code}{_detail(response)}")
    return response


def _detail(response: httpx.Response) -> str:
    """The useful part of an error body: OpenAI error message, or /ready's status and error."""
    try:
        body = response.json()
    except ValueError:
        text = response.text.strip()
        return f": {text[:ERROR_DETAIL_CHARS]}" if text else ""
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and body["error"].get("message"):
            return f": {body['error']['message']}"[:ERROR_DETAIL_CHARS]
        parts = [str(body[key]) for key in ("status", "error", "detail") if body.get(key)]
        if parts:
            return f": {' - '.join(parts)}"[:ERROR_DETAIL_CHARS]
    return f": {str(body)[:ERROR_DETAIL_CHARS]}"


def _json(response: httpx.Response, path: str) -> dict:
    try:
        body = response.json()
    except ValueError:
        raise PollError(f"GET {path}: not JSON: {response.text[:80]!r}") from None
    if not isinstance(body, dict):
        raise PollError(f"GET {path}: expected a JSON object, got {type(body).__name__}")
    return body


def _check_ready(client: httpx.Client, url: str) -> None:
    try:
        _get(client, url, "/ready")
    except PollError as error:
        raise PollError(f"not ready: {error}") from None


def _read_models(client: httpx.Client, url: str) -> tuple[str, list[str]]:
    """(the base model's name, adapter names registered on the worker) from GET /v1/models."""
    body = _json(_get(client, url, "/v1/models"), "/v1/models")
    data = body.get("data")
    if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
        raise PollError("GET /v1/models: no 'data' list of models with ids")
    bases = [m["id"] for m in data if m.get("parent") is None]
    if not bases:
        raise PollError("GET /v1/models: no base model listed")
    return bases[0], [m["id"] for m in data if m.get("parent") is not None]


def _read_base_config(client: httpx.Client, url: str) -> dict:
    """GET /v1/base_model (the base's shapes and adapter limits); {} from a worker without it."""
    try:
        response = _get(client, url, "/v1/base_model")
    except PollError:
        return {}
    if response.status_code != 200:
        return {}
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _read_adapters(client: httpx.Client, url: str, admin_token: str | None) -> tuple[dict | None, str]:
    """({name: tier}, "") from GET /v1/adapters, or (None, warning) when it cannot be read.
    The worker still serves without it, so this alone does not make it unhealthy."""
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else None
    try:
        body = _json(_get(client, url, "/v1/adapters", headers=headers), "/v1/adapters")
        data = body.get("data")
        if not isinstance(data, list):
            raise PollError("GET /v1/adapters: no 'data' list")
        adapters = {}
        for entry in data:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise PollError(f"GET /v1/adapters: entry without a name: {str(entry)[:80]}")
            adapters[entry["name"]] = str(entry.get("tier") or "unknown")
        return adapters, ""
    except PollError as error:
        hint = ""
        if "HTTP 401" in str(error) or "HTTP 403" in str(error):
            hint = " (INFERENCE_ADMIN_TOKEN does not match the worker's admin token)"
        return None, f"{error}{hint}; adapter residency read from /metrics instead"


def _read_metrics(client: httpx.Client, url: str) -> Probe:
    """Load, KV-cache use, memory gauges, adapter residency and cache counters from GET /metrics."""
    text = _get(client, url, "/metrics").text
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as error:  # the parser raises ValueError, IndexError, ... on bad text
        raise PollError(f"GET /metrics: not Prometheus text ({type(error).__name__}: {error})"[:ERROR_DETAIL_CHARS]) from None

    values: dict[str, list[float]] = {}
    memory: dict[str, int | float] = {}
    resident: dict[str, str] = {}
    cache: dict = {}
    for family in families:
        for sample in family.samples:
            if family.name in CACHE_COUNTERS and sample.name.endswith("_total"):
                _add_cache_counter(cache, CACHE_COUNTERS[family.name], sample)
            elif sample.name in (RUNNING, WAITING, KV_USAGE):
                values.setdefault(sample.name, []).append(sample.value)
            elif sample.name == ADAPTER_RESIDENT and sample.value == 1 and "adapter" in sample.labels:
                resident[sample.labels["adapter"]] = sample.labels.get("tier", "unknown")
            elif family.type == "gauge" and "memory" in family.name.lower():
                labels = [v for k, v in sorted(sample.labels.items()) if k != "model_name"]
                memory[",".join(labels) or sample.name] = _number(sample.value)

    missing = [name for name in (RUNNING, WAITING, KV_USAGE) if name not in values]
    if missing:
        raise PollError(f"GET /metrics: missing {', '.join(missing)}")
    for name, samples in values.items():
        if any(v != v or v < 0 for v in samples):  # NaN or negative
            raise PollError(f"GET /metrics: {name} has a bad value {samples}")
    # One sample per engine (label sets differ only by model_name/engine): queues add up,
    # KV use is the fullest engine's.
    return Probe(
        healthy=True,
        num_running=int(sum(values[RUNNING])),
        num_waiting=int(sum(values[WAITING])),
        kv_cache_usage=float(min(max(values[KV_USAGE]), 1.0)),
        resident_adapters=resident,
        memory=memory,
        cache_stats=cache,
    )


def _add_cache_counter(cache: dict, key: str, sample) -> None:
    """One counter sample into {"hits": {tier: n}, "misses": n, ...}; bad values are dropped
    (a hit rate is a nicety: it never makes a serving worker unhealthy)."""
    value = sample.value
    if value != value or value < 0 or value == float("inf"):
        return
    if key in PER_TIER:
        tier = sample.labels.get("tier", "unknown")
        tiers = cache.setdefault(key, {})
        tiers[tier] = tiers.get(tier, 0) + int(value)
    else:
        cache[key] = cache.get(key, 0) + int(value)


def _number(value: float) -> int | float:
    return int(value) if value == value and value.is_integer() else value

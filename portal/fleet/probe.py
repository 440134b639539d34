"""What one poll of a worker reads, through the worker client: GET /ready, /v1/models, /metrics
(Prometheus text: load, KV-cache use, memory, adapter residency, cache counters),
/v1/base_model and, with the admin token, /v1/adapters. HTTP only: no ORM, safe on any
thread, never raises (portal.fleet.services records the Probe on the worker's row).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from portal.fleet.client import DETAIL_CHARS, Reply, WorkerClient, models_from_json
from protocol import worker_api
from protocol.worker_api import BaseModelInfo

logger = logging.getLogger(__name__)

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
    # The KV prefix cache, in prompt tokens (looked up / found): the fleet page's prefix hit rate.
    "vllm:prefix_cache_queries": "prefix_queries",
    "vllm:prefix_cache_hits": "prefix_hits",
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
    # True when resident_adapters is the worker's whole adapter list (GET /v1/adapters, every
    # tier incl. "disk"), False when it was pieced together from /metrics or /v1/models.
    adapters_listed: bool = False


def probe_worker(url: str, *, client: WorkerClient) -> Probe:
    """Ask one worker how it is. Never raises; touches no database."""
    try:
        _check_ready(client, url)
        models = _read_models(client, url)
        probe = _read_metrics(client, url)
        probe.base_model = models.base
        probe.base_config = _read_base_config(client, url)
        adapters, warning = _read_adapters(client, url)
        probe.adapters_listed = adapters is not None
        if adapters is None:
            # Fall back to what needs no token: residency gauges in /metrics, else the names.
            adapters = probe.resident_adapters or {name: "registered" for name in models.adapters}
        probe.resident_adapters = adapters
        probe.error = warning
        return probe
    except PollError as error:
        return Probe(healthy=False, error=str(error))
    except Exception as error:  # a worker must never break the poll of the others
        logger.exception("fleet: unexpected failure polling %s", url)
        return Probe(healthy=False, error=f"unexpected {type(error).__name__}: {error}"[:DETAIL_CHARS])


def _get(client: WorkerClient, url: str, path: str, *, admin: bool = False) -> Reply:
    reply = client.get(url, path, admin=admin)
    if not reply.ok:
        raise PollError(f"GET {path}: {reply.describe()}")
    return reply


def _json(reply: Reply) -> dict:
    try:
        return reply.json_object()
    except ValueError as error:
        raise PollError(f"GET {reply.path}: {error}") from None


def _check_ready(client: WorkerClient, url: str) -> None:
    try:
        _get(client, url, worker_api.READY)
    except PollError as error:
        raise PollError(f"not ready: {error}") from None


def _read_models(client: WorkerClient, url: str):
    """The base model's name and the adapters registered on the worker, from GET /v1/models."""
    try:
        return models_from_json(_json(_get(client, url, worker_api.MODELS)))
    except ValueError as error:
        raise PollError(f"GET {worker_api.MODELS}: {error}") from None


def _read_base_config(client: WorkerClient, url: str) -> dict:
    """GET /v1/base_model (the base's shapes and adapter limits); {} from a worker without it."""
    reply = client.get(url, worker_api.BASE_MODEL)
    if not reply.ok:
        return {}
    try:
        info = BaseModelInfo.from_json(reply.json_object())
    except ValueError:
        return {}
    return info.to_json() if info is not None else {}


def _read_adapters(client: WorkerClient, url: str) -> tuple[dict | None, str]:
    """({name: tier}, "") from GET /v1/adapters, or (None, warning) when it cannot be read.
    The worker still serves without it, so this alone does not make it unhealthy."""
    path = worker_api.ADAPTERS
    try:
        reply = _get(client, url, path, admin=True)
        data = _json(reply).get("data")
        if not isinstance(data, list):
            raise PollError(f"GET {path}: no 'data' list")
        adapters = {}
        for entry in data:
            if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
                raise PollError(f"GET {path}: entry without a name: {str(entry)[:80]}")
            adapters[entry["name"]] = str(entry.get("tier") or "unknown")
        return adapters, ""
    except PollError as error:
        hint = ""
        if "HTTP 401" in str(error) or "HTTP 403" in str(error):
            hint = " (INFERENCE_ADMIN_TOKEN does not match the worker's admin token)"
        return None, f"{error}{hint}; adapter residency read from /metrics instead"


def _read_metrics(client: WorkerClient, url: str) -> Probe:
    """Load, KV-cache use, memory gauges, adapter residency and cache counters from GET /metrics."""
    text = _get(client, url, worker_api.METRICS).body.decode("utf-8", "replace")
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as error:  # the parser raises ValueError, IndexError, ... on bad text
        raise PollError(f"GET /metrics: not Prometheus text ({type(error).__name__}: {error})"[:DETAIL_CHARS]) from None

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

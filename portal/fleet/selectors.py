"""Reads on the fleet: where to send a request, and the fleet's base model.

Routing (route_candidates) is adapter affinity with bounded load over rendezvous hashing:

1. healthy enabled workers where the adapter is resident (RESIDENT_TIERS) and whose load
   (running + waiting at the last poll) is under `max_load`, least loaded first;
2. every other worker under the bound, in rendezvous order of (lora_name or "base", url):
   score = sha256(key + url), highest first. Each adapter has its own stable order over
   the fleet, so a cold adapter keeps landing on the same worker (which then holds it), and
   adding or removing a worker moves only about 1/N of the adapters;
3. workers at or over the bound last, in the same rendezvous order (a last resort, not a
   refusal: the worker itself answers 503 when its queue is full).

The gateway tries the list in order, moving on when a worker fails before the first byte.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from django.conf import settings
from django.db.models import F

from portal.fleet.models import RESIDENT_TIERS, InferenceWorker, normalize_worker_url

# Requests (running + waiting) above which a worker stops attracting its resident adapters'
# traffic: settings.FLEET_MAX_LOAD (64 by default; the engine's default batch is 128 sequences).
BASE_KEY = "base"


@dataclass(frozen=True)
class WorkerTarget:
    url: str
    name: str
    id: int | None  # None: a settings URL with no polled row yet


def route_candidates(*, lora_name: str | None, max_load: int | None = None,
                     inflight: Mapping[str, int] | None = None) -> list[WorkerTarget]:
    """Workers to try for a request for `lora_name` (the worker-side adapter name, or None for
    the base model), best first. When no row is healthy (fresh start, nothing polled yet, or
    every poll failing) it falls back to settings.INFERENCE_URLS, minus workers disabled in
    the admin, in rendezvous order. An empty list means there is nowhere to send it."""
    if max_load is None:
        max_load = settings.FLEET_MAX_LOAD
    workers = list(InferenceWorker.objects.filter(enabled=True, healthy=True))
    if workers:
        return rank_workers(workers, lora_name=lora_name, max_load=max_load, inflight=inflight or {})
    disabled = set(InferenceWorker.objects.filter(enabled=False).values_list("url", flat=True))
    urls = [url for url in (normalize_worker_url(u) for u in settings.INFERENCE_URLS) if url not in disabled]
    key = lora_name or BASE_KEY
    return [WorkerTarget(url=url, name=url.split("://", 1)[1], id=None)
            for url in sorted(urls, key=lambda url: rendezvous_score(key, url), reverse=True)]


def rank_workers(workers: Iterable[InferenceWorker], *, lora_name: str | None, max_load: int,
                 inflight: Mapping[str, int] | None = None) -> list[WorkerTarget]:
    """The routing order over these rows (already filtered to healthy and enabled). Pure.

    inflight: {url: requests the caller itself has in flight there} (portal.fleet.inflight); a
    worker's load is the larger of that and its polled load, which may be seconds old."""
    workers = list(workers)
    inflight = inflight or {}
    load = {w.url: max(w.load, inflight.get(w.url, 0)) for w in workers}
    key = lora_name or BASE_KEY
    scored = [(rendezvous_score(key, w.url), w) for w in workers]
    by_hash = [w for _, w in sorted(scored, key=lambda pair: pair[0], reverse=True)]
    rank = {w.url: i for i, w in enumerate(by_hash)}

    def resident(w: InferenceWorker) -> bool:
        return lora_name is not None and (w.resident_adapters or {}).get(lora_name) in RESIDENT_TIERS

    affine = sorted((w for w in by_hash if resident(w) and load[w.url] < max_load),
                    key=lambda w: (load[w.url], rank[w.url]))
    chosen = {w.url for w in affine}
    spill = [w for w in by_hash if w.url not in chosen and load[w.url] < max_load]
    overloaded = [w for w in by_hash if w.url not in chosen and load[w.url] >= max_load]
    return [WorkerTarget(url=w.url, name=w.name or w.url.split("://", 1)[1], id=w.pk)
            for w in (*affine, *spill, *overloaded)]


def rendezvous_score(key: str, url: str) -> bytes:
    """Highest random weight hashing: compare sha256(key + url) digests, highest wins."""
    return hashlib.sha256(f"{key}{url}".encode()).digest()


def base_model_name() -> str | None:
    """The base model the fleet serves (its name in the workers' /v1/models): the most common
    among healthy enabled workers, else the last one any enabled worker reported, else None
    (nothing has been polled successfully yet)."""
    healthy = list(
        InferenceWorker.objects.filter(enabled=True, healthy=True).exclude(base_model="")
        .order_by("url").values_list("base_model", flat=True)
    )
    if healthy:
        return Counter(healthy).most_common(1)[0][0]
    last = (
        InferenceWorker.objects.filter(enabled=True).exclude(base_model="")
        .order_by(F("last_seen_at").desc(nulls_last=True)).values_list("base_model", flat=True).first()
    )
    return last


def base_model_config() -> dict | None:
    """The served base's shapes and adapter limits (GET /v1/base_model of a healthy worker
    serving base_model_name()), or None when no worker has reported them."""
    name = base_model_name()
    rows = InferenceWorker.objects.filter(enabled=True, base_model=name).exclude(base_config={})
    row = rows.order_by("-healthy", F("last_seen_at").desc(nulls_last=True)).first()
    return dict(row.base_config) if row else None


def worker_list() -> list[InferenceWorker]:
    """Every worker row, for dashboards."""
    return list(InferenceWorker.objects.order_by("url"))

"""Reads on the fleet: where to send a request, and the fleet's base model.

Routing (route_candidates) is adapter affinity with bounded load over rendezvous hashing. A
worker's load is what the last poll read (running + waiting) corrected by this process's own
requests since (worker_load); the bound is relative, c x the fleet's mean load (load_bound:
consistent hashing with bounded loads), never under LOAD_FLOOR and never over `max_load`.

1. healthy enabled workers under the bound where the adapter is resident (RESIDENT_TIERS),
   those holding it in a device slot first, then in host memory, then loading; least loaded
   first within each;
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
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import connection
from django.db.models import F, Min
from django.utils import timezone

from portal.core.ranges import TimeRange
from portal.fleet.history import (
    WIDTH,
    floor,
    folded_until,
    gauge_mean,
    gauge_peak,
    history_resolution,
)
from portal.fleet.inflight import InflightSnapshot
from portal.fleet.models import (
    COUNTERS,
    GAUGES,
    MEMORY_KINDS,
    RESIDENT_TIERS,
    WORKER_STATES,
    InferenceWorker,
    Resolution,
    WorkerEvent,
    WorkerSample,
    normalize_worker_url,
)

BASE_KEY = "base"
# The relative bound is never below this: with few requests in flight (3 over 16 workers: the
# bound would be 1) one more on the worker already holding the adapter costs a batch slot, while
# the next worker in line would load the adapter cold, evicting one of its own.
LOAD_FLOOR = 8
# Where a worker holds the adapter, best first: in a device slot (nothing to do), in host memory
# (copied into a slot, evicting another adapter the worker serves), still loading.
RESIDENT_PREFERENCE = {"device": 0, "host": 1, "loading": 2}


@dataclass(frozen=True)
class WorkerTarget:
    url: str
    name: str
    id: int | None  # None: a settings URL with no polled row yet


def route_rows() -> tuple[list[InferenceWorker], frozenset[str]]:
    """What route_candidates reads from the database: the healthy enabled rows, and (only when
    there are none) the urls of disabled workers. The gateway reuses them (up to a poll old:
    portal.gateway.cache.FleetValues)."""
    workers = list(InferenceWorker.objects.filter(enabled=True, healthy=True))
    if workers:
        return workers, frozenset()
    return [], frozenset(InferenceWorker.objects.filter(enabled=False).values_list("url", flat=True))


def route_candidates(*, lora_name: str | None, max_load: int | None = None,
                     inflight: Mapping[str, int] | None = None, prefix_key: str | None = None,
                     rows: tuple[list[InferenceWorker], frozenset[str]] | None = None) -> list[WorkerTarget]:
    """Workers to try for a request for `lora_name` (the worker-side adapter name, or None for
    the base model), best first. When no row is healthy (fresh start, nothing polled yet, or
    every poll failing) it falls back to settings.INFERENCE_URLS, minus workers disabled in
    the admin, in rendezvous order. An empty list means there is nowhere to send it.
    prefix_key: what the prompt starts with, hashed (see rank_workers). rows: route_rows(), when
    the caller has them (no query then)."""
    if max_load is None:
        max_load = settings.FLEET_MAX_LOAD
    workers, disabled = rows if rows is not None else route_rows()
    if workers:
        return rank_workers(workers, lora_name=lora_name, max_load=max_load, inflight=inflight,
                            prefix_key=prefix_key)
    urls = [url for url in (normalize_worker_url(u) for u in settings.INFERENCE_URLS) if url not in disabled]
    key = routing_key(lora_name, prefix_key)
    return [WorkerTarget(url=url, name=url.split("://", 1)[1], id=None)
            for url in sorted(urls, key=lambda url: rendezvous_score(key, url), reverse=True)]


def rank_workers(workers: Iterable[InferenceWorker], *, lora_name: str | None, max_load: int,
                 inflight: Mapping[str, int] | None = None, load_factor: float | None = None,
                 prefix_key: str | None = None) -> list[WorkerTarget]:
    """The routing order over these rows (already filtered to healthy and enabled). Pure.

    inflight: what the caller itself has in flight on each worker (portal.fleet.inflight; see
    worker_load). load_factor: c in the relative bound (load_bound), settings.FLEET_LOAD_FACTOR
    by default; max_load caps it (settings.FLEET_MAX_LOAD). prefix_key: a hash of how the
    prompt starts (routing_key)."""
    workers = list(workers)
    if load_factor is None:
        load_factor = settings.FLEET_LOAD_FACTOR
    load = {w.url: worker_load(w, inflight if inflight is not None else {}) for w in workers}
    bound = load_bound(load.values(), load_factor=load_factor, max_load=max_load)
    key = routing_key(lora_name, prefix_key)
    scored = [(rendezvous_score(key, w.url), w) for w in workers]
    by_hash = [w for _, w in sorted(scored, key=lambda pair: pair[0], reverse=True)]
    rank = {w.url: i for i, w in enumerate(by_hash)}

    def tier(w: InferenceWorker) -> int | None:  # RESIDENT_PREFERENCE; None: not resident
        found = (w.resident_adapters or {}).get(lora_name) if lora_name is not None else None
        return RESIDENT_PREFERENCE.get(found, len(RESIDENT_PREFERENCE)) if found in RESIDENT_TIERS else None

    under = [w for w in by_hash if load[w.url] < bound]
    # Device tier first. Least loaded first among all holders, a hot adapter went to whichever
    # holder had it only in host memory, evicting that worker's own adapters from their slots:
    # 78-81% device hits where the hot set fits the slots, 91-92% device first (bench/fleet_sim.py).
    if lora_name is not None and prefix_key:
        # A conversation (or a shared system prompt) of this adapter keeps to one holder in each
        # tier, where its KV is in the prefix cache; load counts only through the bound.
        rank = {w.url: i for i, w in enumerate(sorted(
            workers, key=lambda w: rendezvous_score(f"{lora_name}:{prefix_key}", w.url), reverse=True))}
        affine = sorted((w for w in under if tier(w) is not None), key=lambda w: (tier(w), rank[w.url]))
    else:
        affine = sorted((w for w in under if tier(w) is not None), key=lambda w: (tier(w), load[w.url], rank[w.url]))
    chosen = {w.url for w in affine}
    spill = [w for w in under if w.url not in chosen]
    overloaded = [w for w in by_hash if load[w.url] >= bound]
    return [WorkerTarget(url=w.url, name=w.name or w.url.split("://", 1)[1], id=w.pk)
            for w in (*affine, *spill, *overloaded)]


def routing_key(lora_name: str | None, prefix_key: str | None) -> str:
    """The rendezvous key. An adapter's requests follow the adapter (its holders, then one stable
    order for the cold case, so it loads on one worker); among its holders, one conversation keeps
    to one (rank_workers). A base-model request follows its prompt's start (its first message:
    the system prompt, the same on every turn of a conversation) so each conversation and each
    shared system prompt keeps finding its KV in one worker's prefix cache, while different ones
    spread over the fleet instead of all queueing for the one worker "base" hashes to."""
    if lora_name is not None:
        return lora_name
    return f"{BASE_KEY}:{prefix_key}" if prefix_key else BASE_KEY


def worker_load(worker: InferenceWorker, inflight: Mapping[str, int]) -> int:
    """Requests on the worker now, as far as this process can tell: its polled load (running +
    waiting, up to a poll interval old) plus the change in this process's own count since that
    poll (InflightSnapshot.change_since), never less than the own count. With a plain mapping
    of own counts, or a poll older than the snapshot remembers: the larger of the two."""
    own = inflight.get(worker.url, 0)
    change = None
    if isinstance(inflight, InflightSnapshot) and worker.last_polled_at is not None:
        change = inflight.change_since(worker.url, worker.last_polled_at.timestamp())
    if change is None:
        return max(worker.load, own)
    return max(worker.load + change, own)


def load_bound(loads: Iterable[int], *, load_factor: float, max_load: int) -> int:
    """Requests in flight at or above which a worker is passed by: consistent hashing with
    bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018), ceil(c * (total + 1) / n), c times the
    fleet's mean load once this request is placed. While c >= 1 some worker is always under it,
    and the one that takes the request is then at most at it, however hot one adapter is.
    Never under LOAD_FLOOR, never over max_load (FLEET_MAX_LOAD, the hard cap)."""
    loads = list(loads)
    relative = math.ceil(load_factor * (sum(loads) + 1) / max(len(loads), 1))
    return min(max(relative, LOAD_FLOOR), max_load)


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


def base_model_first_seen(name: str) -> datetime | None:
    """When the fleet first knew a worker serving the base `name` (its earliest worker row that
    reports it), or None when no row does."""
    return InferenceWorker.objects.filter(base_model=name).aggregate(first=Min("created_at"))["first"]


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


def worker_state_counts() -> dict[str, int]:
    """Workers by state (InferenceWorker.state: healthy, unhealthy, mismatched, gone, disabled),
    for /metrics."""
    counts = dict.fromkeys(WORKER_STATES, 0)
    for worker in InferenceWorker.objects.only("enabled", "healthy", "gone_since", "last_error"):
        counts[worker.state] += 1
    return counts


# -- history (portal.fleet.history keeps it) --------------------------------------------------

# How far before the first bucket the history query also reads, so the first bucket's counters
# have a previous value to differ from (a worker unseen for longer counts from its next poll).
LOOKBACK = {Resolution.RAW: timedelta(minutes=5), Resolution.MINUTE: timedelta(minutes=30),
            Resolution.HOUR: timedelta(days=1)}
# The rates: (series, key) <- the counter whose differences they are. Loads "host": adapters read
# from disk into host memory; "device": adapters copied from host memory into a device slot
# (a request that found its adapter in host memory: hits{tier=host}).
RATES = {("loads_per_min", "host"): "loads", ("loads_per_min", "device"): "hits_host",
         ("evictions_per_min", "device"): "evictions_device", ("evictions_per_min", "host"): "evictions_host",
         ("load_failures_per_min", None): "load_failures"}
MIN_RATE_SPAN = timedelta(seconds=10)  # one poll (portal.fleet.tasks.POLL_EVERY_SECONDS)
_EPOCH_SQL = "TIMESTAMPTZ '1970-01-01 00:00:00+00'"


def fleet_history(*, time_range: TimeRange, worker: int | None = None, now: datetime | None = None) -> dict:
    """The fleet's history over `time_range` in its buckets, JSON-ready: summed over the workers
    healthy in each bucket (kv_cache_usage: their mean, a fraction of each one's KV cache), or
    one worker's (`worker` = its id). A worker's value in a bucket is its mean over its healthy
    polls there; None where no worker was seen healthy. `peak`: the max within the bucket
    (num_running, num_waiting: the sum of each worker's max, an upper bound of the fleet's at
    any moment; kv_cache_usage: the fullest worker's). Rates per minute come from differences of
    consecutive counter values (a drop is a worker restart: the new value is the difference).
    Reads the coarsest resolution that holds the range and fits its buckets (history_resolution:
    the same numbers as the raw polls, from fewer rows); the newest rows not folded into it yet
    come from raw polls. `healthy`: workers seen healthy per bucket."""
    now = now or timezone.now()
    buckets = time_range.buckets()
    first = buckets[0] if buckets else time_range.floor(time_range.start)
    resolution = history_resolution(first, time_range.bucket, now=now)
    rows = _history_rows(time_range, resolution=resolution, first=first, worker=worker)
    index = {moment: i for i, moment in enumerate(buckets)}
    n = len(buckets)
    per_bucket: list[list[dict]] = [[] for _ in range(n)]
    worker_ids = set()
    for row in rows:
        i = index.get(row["bucket"])
        if i is not None:
            per_bucket[i].append(row)
            worker_ids.add(row["worker_id"])

    # The minutes a bucket's differences span: the bucket, up to `end` for the one in progress
    # (at least a poll); a row's width where rows are wider than buckets (hour rows of a range
    # older than MINUTE_KEEP cut into minutes).
    row_width = WIDTH.get(resolution, MIN_RATE_SPAN)
    row_width = row_width if row_width > time_range.bucket else MIN_RATE_SPAN
    minutes = [max(min(b + time_range.bucket, time_range.end) - b, row_width).total_seconds() / 60 for b in buckets]

    def total(name: str) -> list:
        return [_sum(r[name] for r in rs) if rs else None for rs in per_bucket]

    def rate(counter: str) -> list:
        out = []
        for rs, span in zip(per_bucket, minutes, strict=True):
            deltas = [r[f"d_{counter}"] for r in rs if r[f"d_{counter}"] is not None]
            out.append(sum(deltas) / span if deltas else None)
        return out

    series = {
        "num_running": total("num_running"),
        "num_waiting": total("num_waiting"),
        "kv_cache_usage": [_mean(r["kv_cache_usage"] for r in rs) if rs else None for rs in per_bucket],
        "adapters": {"device": total("adapters_device"), "host": total("adapters_host")},
        "loads_per_min": {}, "evictions_per_min": {},
        "memory": {kind: [_int(v) for v in total(f"memory_{kind}")] for kind in MEMORY_KINDS},
        "peak": {"num_running": total("num_running_max"), "num_waiting": total("num_waiting_max"),
                 "kv_cache_usage": [max((r["kv_cache_usage_max"] for r in rs if r["kv_cache_usage_max"] is not None),
                                        default=None) for rs in per_bucket]},
        "healthy": [len(rs) for rs in per_bucket],
    }
    for (name, key), counter in RATES.items():
        if key is None:
            series[name] = rate(counter)
        else:
            series[name][key] = rate(counter)

    events = WorkerEvent.objects.filter(at__gte=first, at__lt=time_range.end)
    if worker is not None:
        events = events.filter(worker_id=worker)
    events = list(events.order_by("at", "id"))
    worker_ids.update(e.worker_id for e in events)
    if worker is not None:
        worker_ids.add(worker)
    return {
        "buckets": [b.isoformat() for b in buckets],
        "workers": _history_workers(worker_ids),
        "series": series,
        "annotations": [{"at": e.at.isoformat(), "worker": e.worker_name, "worker_id": e.worker_id, "kind": e.kind,
                         "detail": e.detail} for e in events],
        "resolution": str(resolution),
    }


def _history_rows(time_range: TimeRange, *, resolution: str, first: datetime, worker: int | None) -> list[dict]:
    """One dict per (worker, bucket) with a healthy sample: gauge means and maxes, counter
    differences summed. Rows of `resolution` up to where it is folded, raw rows after that
    (two index range scans on (resolution, at), put end to end)."""
    since = first - LOOKBACK[resolution]
    folded = since if resolution == Resolution.RAW else max(folded_until(resolution) or since, since)
    # Raw polls from where the folded rows end, reaching back no further than raw rows need to.
    params = {"res": resolution, "since": since, "folded": min(folded, time_range.end), "end": time_range.end,
              "raw_since": min(max(folded, first - LOOKBACK[Resolution.RAW]), time_range.end),
              "bucket": time_range.bucket, "worker": worker}
    if connection.vendor != "postgresql":
        return _history_rows_in_python(params)
    table = WorkerSample._meta.db_table
    columns = ", ".join(["worker_id", "at", "samples", *GAUGES, *(f"{g}_max" for g in GAUGES), *COUNTERS])
    mine = " AND samples > 0" + (" AND worker_id = %(worker)s" if worker is not None else "")
    lag = ", ".join(f"CASE WHEN {c} < LAG({c}) OVER w THEN {c} ELSE {c} - LAG({c}) OVER w END AS d_{c}"
                    for c in COUNTERS)
    means = ", ".join(f"SUM({g} * samples) / NULLIF(SUM(CASE WHEN {g} IS NOT NULL THEN samples END), 0) AS {g}, "
                      f"MAX({g}_max) AS {g}_max" for g in GAUGES)
    deltas = ", ".join(f"SUM(d_{c})::float8 AS d_{c}" for c in COUNTERS)
    sql = (f"WITH src AS (SELECT {columns} FROM {table} "
           f"WHERE resolution = %(res)s AND at >= %(since)s AND at < %(folded)s{mine} "
           f"UNION ALL SELECT {columns} FROM {table} "
           f"WHERE resolution = 'raw' AND at >= %(raw_since)s AND at < %(end)s{mine}), "
           f"diffs AS (SELECT *, {lag} FROM src WINDOW w AS (PARTITION BY worker_id ORDER BY at)) "
           f"SELECT worker_id, date_bin(%(bucket)s, at, {_EPOCH_SQL}) AS bucket, {means}, {deltas} "
           "FROM diffs GROUP BY 1, 2 ORDER BY 2, 1")
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        names = [column.name for column in cursor.description]
        return [dict(zip(names, values, strict=True)) for values in cursor.fetchall()]


def _history_rows_in_python(params: dict) -> list[dict]:
    """_history_rows on any other backend (the embedded SQLite of `make run`: no date_bin, no
    window functions over intervals): the same rows read through the ORM and the same sums made
    here, for the few workers and hours such a database holds."""
    columns = ["worker_id", "at", "samples", *GAUGES, *(f"{g}_max" for g in GAUGES), *COUNTERS]
    mine = {"samples__gt": 0, **({"worker_id": params["worker"]} if params["worker"] is not None else {})}
    folded = WorkerSample.objects.filter(resolution=params["res"], at__gte=params["since"],
                                         at__lt=params["folded"], **mine)
    raw = WorkerSample.objects.filter(resolution=Resolution.RAW, at__gte=params["raw_since"], at__lt=params["end"],
                                      **mine)
    previous: dict[int, dict] = {}
    groups: dict[tuple[datetime, int], list[dict]] = {}
    for row in sorted([*folded.values(*columns), *raw.values(*columns)], key=lambda r: (r["worker_id"], r["at"])):
        last = previous.get(row["worker_id"])
        for c in COUNTERS:  # a drop is a restart: the new value is the difference
            known = last is not None and row[c] is not None and last[c] is not None
            row[f"d_{c}"] = (row[c] if row[c] < last[c] else row[c] - last[c]) if known else None
        previous[row["worker_id"]] = row
        groups.setdefault((floor(row["at"], params["bucket"]), row["worker_id"]), []).append(row)
    out = []
    for (bucket, worker_id), rows in sorted(groups.items()):
        summed = {"worker_id": worker_id, "bucket": bucket}
        for g in GAUGES:
            summed[g], summed[f"{g}_max"] = gauge_mean(rows, g), gauge_peak(rows, g)
        for c in COUNTERS:
            deltas = [r[f"d_{c}"] for r in rows if r[f"d_{c}"] is not None]
            summed[f"d_{c}"] = float(sum(deltas)) if deltas else None
        out.append(summed)
    return out


def _history_workers(ids: set[int]) -> list[dict]:
    """{"id", "name"} of each worker in a history, by name; a worker whose row is gone since is
    named as its last event named it."""
    names = {pk: str(w) for pk, w in InferenceWorker.objects.in_bulk(list(ids)).items()}
    missing = ids - names.keys()
    for event in WorkerEvent.objects.filter(worker_id__in=missing).order_by("at"):
        names[event.worker_id] = event.worker_name
    return sorted(({"id": pk, "name": names.get(pk, f"worker {pk}")} for pk in ids),
                  key=lambda w: (w["name"], w["id"]))


def _sum(values) -> float | None:
    known = [v for v in values if v is not None]
    return float(sum(known)) if known else None


def _mean(values) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _int(value: float | None) -> int | None:
    return round(value) if value is not None else None

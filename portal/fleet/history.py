"""The fleet's history: what each poll saw on each worker, kept over time at three resolutions.

    every poll (10 s)   raw rows      kept RAW_KEEP     (24 h:   8,640 rows per worker)
    1 minute            minute rows   kept MINUTE_KEEP  (14 d:  20,160 rows per worker)
    1 hour              hour rows     kept HOUR_KEEP    (400 d:  9,600 rows per worker)

portal.fleet.services writes one raw WorkerSample per worker per poll (one bulk insert) and a
WorkerEvent when a worker's state changes. history_fold (a beat task, every minute) folds each
complete minute of raw rows into minute rows and each complete hour of minute rows into hour
rows, as soon as they are complete (not when they expire), so every resolution reaches up to
the last complete bucket and the history selector can read any range from one of them; then
it deletes what is past its retention and already folded. Gauges fold to their mean over the
healthy polls (weighted by `samples`, so an hour's mean is the mean of its polls, not of its
minutes) and their max; cumulative counters fold to their last value (rates come from
differences); `state` to the last one. On PostgreSQL a fold is one INSERT ... SELECT; on any
other backend (the embedded SQLite of `make run`) the same fold runs over rows read by the ORM.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models import Max

from portal.fleet.models import (
    COUNTERS,
    GAUGES,
    MEMORY_KINDS,
    SAMPLE_TIERS,
    InferenceWorker,
    Resolution,
    WorkerEvent,
    WorkerSample,
)

# Retention. Raw: a day of 10 s detail, enough for "what happened in the last hours". Minute:
# two weeks, so last week's incident still has minute detail. Hour: 400 days, the longest range
# the dashboards take (portal.core.ranges.MAX_SPAN), so a year-on-year comparison works.
RAW_KEEP = timedelta(hours=24)
MINUTE_KEEP = timedelta(days=14)
HOUR_KEEP = timedelta(days=400)
EVENT_KEEP = timedelta(days=400)
KEEP = {Resolution.RAW: RAW_KEEP, Resolution.MINUTE: MINUTE_KEEP, Resolution.HOUR: HOUR_KEEP}
WIDTH = {Resolution.MINUTE: timedelta(minutes=1), Resolution.HOUR: timedelta(hours=1)}
# What each resolution is folded from.
SOURCE = {Resolution.MINUTE: Resolution.RAW, Resolution.HOUR: Resolution.MINUTE}
FOLD_EVERY_SECONDS = 60.0
# A bucket is folded once it ended this long ago: a poll's row is written a few seconds after
# its `at` (probes time out after 2 s), and must not arrive after its minute was folded.
FOLD_GRACE = timedelta(seconds=30)
# What an unreachable or unusable worker's sample says: nothing known.
_NOTHING = {**{name: None for name in GAUGES}, **{f"{name}_max": None for name in GAUGES},
            **{name: None for name in COUNTERS}}


# -- recording (called by portal.fleet.services at each poll) ---------------------------------


def worker_condition(worker: InferenceWorker) -> str:
    """The WorkerEvent kind the row is in: healthy, unhealthy, draining (its /ready says so after
    SIGTERM), mismatched, gone, or "" for a disabled worker (not polled: no history)."""
    state = worker.state
    if state == "unhealthy" and worker.last_error.endswith(": draining"):
        return WorkerEvent.Kind.DRAINING
    return "" if state == "disabled" else state


def sample_of(worker: InferenceWorker, *, now: datetime) -> WorkerSample:
    """The raw sample of a row just recorded by a poll (unsaved)."""
    condition = worker_condition(worker)
    # Healthy means serving: a gone worker polled from the admin may answer, but gets no traffic.
    healthy = condition == WorkerEvent.Kind.HEALTHY
    sample = WorkerSample(worker_id=worker.pk, at=now, resolution=Resolution.RAW, polls=1,
                          samples=int(healthy), healthy=healthy, state=condition, **_NOTHING)
    if not healthy:
        return sample
    tiers = Counter((worker.resident_adapters or {}).values())
    memory = worker.memory or {}
    stats = worker.cache_stats or {}
    gauges = {"num_running": worker.num_running, "num_waiting": worker.num_waiting,
              "kv_cache_usage": worker.kv_cache_usage,
              **{f"adapters_{tier}": tiers.get(tier, 0) for tier in SAMPLE_TIERS},
              **{f"memory_{kind}": memory.get(kind) for kind in MEMORY_KINDS}}
    for name, value in gauges.items():
        setattr(sample, name, value)
        setattr(sample, f"{name}_max", value)
    counters = {"loads": stats.get("loads"), "load_failures": stats.get("load_failures"),
                "misses": stats.get("misses")}
    for key in ("hits", "evictions"):
        for tier in ("device", "host"):
            counters[f"{key}_{tier}"] = (stats.get(key) or {}).get(tier)
    for name, value in counters.items():
        setattr(sample, name, value)
    return sample


def event_detail(worker: InferenceWorker, kind: str) -> str:
    if kind == WorkerEvent.Kind.HEALTHY:
        return f"serves {worker.base_model}" + (f"; {worker.last_error}" if worker.last_error else "")
    return worker.last_error


# -- folding and retention (the beat task) ----------------------------------------------------


def history_fold(*, now: datetime) -> dict[str, int]:
    """Fold complete minutes of raw rows into minute rows and complete hours of minute rows into
    hour rows, then delete what is past its retention; returns rows written/deleted by name."""
    done = {"minute": _fold(Resolution.MINUTE, now=now), "hour": _fold(Resolution.HOUR, now=now)}
    done.update(history_prune(now=now))
    return done


def folded_until(resolution: str) -> datetime | None:
    """The end of the last bucket folded into `resolution` (raw rows from then on are not
    folded yet), or None when nothing was folded into it."""
    last = WorkerSample.objects.filter(resolution=resolution).aggregate(last=Max("at"))["last"]
    return last + WIDTH[resolution] if last is not None else None


def floor(moment: datetime, width: timedelta) -> datetime:
    epoch = datetime(1970, 1, 1, tzinfo=moment.tzinfo)
    return moment - (moment - epoch) % width


_AVG = "SUM({g} * samples) / NULLIF(SUM(CASE WHEN {g} IS NOT NULL THEN samples END), 0)"
_LAST = "(ARRAY_AGG({c} ORDER BY at DESC) FILTER (WHERE {c} IS NOT NULL))[1]"


@transaction.atomic
def _fold(target: str, *, now: datetime) -> int:
    """Fold the source rows of the complete target buckets not yet folded (from the end of the
    last target row; all source rows when there is none) into target rows. Upserts, so a rerun
    over the same buckets writes the same rows."""
    width = WIDTH[target]
    until = floor(now - FOLD_GRACE, width)
    since = folded_until(target)
    if since is not None and since >= until:
        return 0
    fold = _fold_in_sql if connection.vendor == "postgresql" else _fold_in_python
    return fold(target, since=since, until=until)


def _fold_in_sql(target: str, *, since: datetime | None, until: datetime) -> int:
    """PostgreSQL: one INSERT ... SELECT ... ON CONFLICT, so no row leaves the database."""
    width = WIDTH[target]
    gauges = list(GAUGES)
    columns = ["worker_id", "at", "resolution", "polls", "samples", "healthy", "state",
               *gauges, *(f"{g}_max" for g in gauges), *COUNTERS]
    selects = [
        "worker_id", "date_bin(%(width)s, at, TIMESTAMPTZ '1970-01-01 00:00:00+00')", "%(target)s",
        "SUM(polls)", "SUM(samples)", "BOOL_OR(healthy)", "(ARRAY_AGG(state ORDER BY at DESC))[1]",
        *(_AVG.format(g=g) for g in gauges), *(f"MAX({g}_max)" for g in gauges),
        *(_LAST.format(c=c) for c in COUNTERS),
    ]
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in columns[3:])
    table = WorkerSample._meta.db_table
    sql = (f"INSERT INTO {table} ({', '.join(columns)}) "
           f"SELECT {', '.join(selects)} FROM {table} "
           f"WHERE resolution = %(source)s AND at < %(until)s" + (" AND at >= %(since)s" if since else "") +
           " GROUP BY 1, 2 "
           f"ON CONFLICT (worker_id, resolution, at) WHERE NOT (resolution = 'raw') DO UPDATE SET {updates}")
    with connection.cursor() as cursor:
        cursor.execute(sql, {"width": width, "target": target, "source": SOURCE[target], "until": until,
                             "since": since})
        return cursor.rowcount


def _fold_in_python(target: str, *, since: datetime | None, until: datetime) -> int:
    """Any other backend (the embedded SQLite of `make run`, which has neither date_bin nor
    ARRAY_AGG): the same fold over rows read through the ORM, bucket by bucket. Its volume is
    one worker's polls for the minutes since the last fold, so reading them is cheap."""
    width = WIDTH[target]
    rows = WorkerSample.objects.filter(resolution=SOURCE[target], at__lt=until)
    if since is not None:
        rows = rows.filter(at__gte=since)
    buckets: dict[tuple[int, datetime], list[dict]] = {}
    for row in rows.order_by("at", "id").values():
        buckets.setdefault((row["worker_id"], floor(row["at"], width)), []).append(row)
    for (worker_id, at), polls in buckets.items():
        WorkerSample.objects.update_or_create(worker_id=worker_id, resolution=target, at=at,
                                              defaults=_folded(polls))
    return len(buckets)


def _folded(polls: list[dict]) -> dict:
    """One bucket's folded values from its rows in time order: what _fold_in_sql's SELECT says."""
    last = polls[-1]
    folded = {"polls": sum(p["polls"] for p in polls), "samples": sum(p["samples"] for p in polls),
              "healthy": any(p["healthy"] for p in polls), "state": last["state"]}
    for gauge in GAUGES:
        folded[gauge], folded[f"{gauge}_max"] = gauge_mean(polls, gauge), gauge_peak(polls, gauge)
    for counter in COUNTERS:
        folded[counter] = next((p[counter] for p in reversed(polls) if p[counter] is not None), None)
    return folded


def gauge_mean(rows: list[dict], gauge: str) -> float | None:
    """The mean of `gauge` over rows' healthy polls (each row weighs its `samples`), None where
    none knows it: SUM(g * samples) / SUM(samples where g is known), as the SQL folds say."""
    known = [r for r in rows if r[gauge] is not None]
    weight = sum(r["samples"] for r in known)
    return sum(r[gauge] * r["samples"] for r in known) / weight if weight else None


def gauge_peak(rows: list[dict], gauge: str) -> float | None:
    return max((r[f"{gauge}_max"] for r in rows if r[f"{gauge}_max"] is not None), default=None)


def history_prune(*, now: datetime) -> dict[str, int]:
    """Delete rows past their retention; raw and minute rows only once they are folded into the
    next resolution (a fold that failed for a day loses no history), events after EVENT_KEEP."""
    deleted = {}
    for resolution, keep in KEEP.items():
        cutoff = now - keep
        coarser = next((t for t, source in SOURCE.items() if source == resolution), None)
        if coarser is not None:
            folded = folded_until(coarser)
            cutoff = min(cutoff, folded) if folded is not None else None
        if cutoff is None:
            deleted[f"{resolution}_deleted"] = 0
            continue
        deleted[f"{resolution}_deleted"], _ = WorkerSample.objects.filter(resolution=resolution, at__lt=cutoff).delete()
    deleted["events_deleted"], _ = WorkerEvent.objects.filter(at__lt=now - EVENT_KEEP).delete()
    return deleted


# -- reading (portal.fleet.selectors.fleet_history) -----------------------------------------------


def history_resolution(first_bucket: datetime, bucket: timedelta, *, now: datetime) -> str:
    """The resolution a history over buckets of `bucket` from `first_bucket` on is read from: the
    coarsest one no wider than the bucket whose retention still holds the first bucket, else the
    finest that holds it (only hour rows are left of a range older than MINUTE_KEEP).

    Buckets are whole minutes or hours aligned to the epoch (portal.core.ranges), so a minute or
    hour row never straddles one, and a bucket's mean (weighted by `samples`), max and last
    counter values read from folded rows equal those read from the raw polls: the coarsest rows
    give the same answer as the finest for far fewer rows (a 6-hour range of 16 workers: 5,760
    minute rows instead of 34,560 polls). Raw polls are read where nothing is folded yet (the
    selector's live edge), or for buckets under a minute."""
    holding = [r for r in (Resolution.RAW, Resolution.MINUTE, Resolution.HOUR) if first_bucket >= now - KEEP[r]]
    if not holding:
        return Resolution.HOUR
    fitting = [r for r in holding if WIDTH.get(r, timedelta(0)) <= bucket]
    return fitting[-1] if fitting else holding[0]

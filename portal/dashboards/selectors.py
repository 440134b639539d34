"""Reads for the staff dashboards: the fleet as the last poll saw it (portal.fleet), usage
summed per adapter over a time range (portal.usage's roll-ups) and billing per month. JSON-ready
dicts only. The series over time (latency, errors, objectives, fleet history) are read by
portal.usage.timeseries and portal.fleet.selectors.

Quota rejections are the ledger's 429 rows: the gateway (and the playground) write one usage
row with status 429 for every request quota admission refused.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import datetime
from decimal import Decimal

from django.db.models import Count, Q, Sum
from django.utils import timezone

from portal.adapters.models import AdapterVersion
from portal.core.ranges import BUCKETS, TimeRange
from portal.fleet.models import InferenceWorker, WorkerDiscovery
from portal.tenants.plans import plan_for
from portal.usage.aggregates import WIDTHS, Dimension
from portal.usage.billing import money, token_cost
from portal.usage.models import ERROR_Q, UsageRecord, UsageRollup
from portal.usage.periods import month_bounds
from portal.usage.timeseries import _cover, _segments_q, usage_totals

MEMORY_KINDS = ("base_weights", "kv_cache", "adapter_slots", "host_adapters")
TIERS = ("device", "host", "loading", "disk", "failed")
QUOTA_REJECTED = Q(status_code=429)


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


# -- fleet ------------------------------------------------------------------------------------
def fleet_overview() -> dict:
    """Every worker row with its last poll, adapters per tier, memory accounting and adapter
    cache hit rates, and totals over the healthy workers."""
    workers = []
    totals = {"workers": 0, "healthy": 0, "num_running": 0, "num_waiting": 0,
              "adapters": dict.fromkeys(TIERS, 0), "memory": dict.fromkeys(MEMORY_KINDS, 0)}
    fleet_counters: list[dict] = []
    for worker in InferenceWorker.objects.order_by("url"):
        tiers = Counter((worker.resident_adapters or {}).values())
        memory = {kind: (worker.memory or {}).get(kind) for kind in MEMORY_KINDS}
        workers.append({
            "id": worker.pk, "name": str(worker), "url": worker.url, "enabled": worker.enabled,
            "healthy": worker.healthy, "state": worker.state, "base_model": worker.base_model,
            "discovered_by": worker.discovered_by, "gone_since": _iso(worker.gone_since), "last_seen_at": _iso(worker.last_seen_at),
            "last_polled_at": _iso(worker.last_polled_at), "last_error": worker.last_error,
            "num_running": worker.num_running, "num_waiting": worker.num_waiting, "queue_depth": worker.load,
            "kv_cache_usage": worker.kv_cache_usage,
            "adapters": {tier: tiers.get(tier, 0) for tier in TIERS},
            "resident_adapters": dict(sorted((worker.resident_adapters or {}).items())),
            "memory": memory,
            "memory_other": {k: v for k, v in (worker.memory or {}).items() if k not in MEMORY_KINDS},
            "cache": cache_rates(worker.cache_stats),
            "prefix_cache": prefix_rates(worker.cache_stats),
        })
        totals["workers"] += 1
        if worker.enabled and worker.healthy:
            totals["healthy"] += 1
            totals["num_running"] += worker.num_running
            totals["num_waiting"] += worker.num_waiting
            for tier in TIERS:
                totals["adapters"][tier] += tiers.get(tier, 0)
            for kind in MEMORY_KINDS:
                totals["memory"][kind] += memory[kind] or 0
            fleet_counters.append(worker.cache_stats or {})
    totals["cache"] = cache_rates(_sum_counters(fleet_counters))
    totals["prefix_cache"] = prefix_rates(_sum_counters(fleet_counters))
    discovery = [{"spec": d.spec, "addresses": d.addresses, "error": d.last_error, "resolved_at": _iso(d.resolved_at),
                  "last_ok_at": _iso(d.last_ok_at)} for d in WorkerDiscovery.objects.order_by("spec")]
    return {"workers": workers, "totals": totals, "discovery": discovery}


def cache_rates(counters: dict | None) -> dict | None:
    """Hit rates from a worker's adapter-cache counters (since it started); None before any
    adapter request. A request takes a slot once (one hit, by the tier the adapter was found
    in); a request whose adapter was on disk first counts a miss, then a hit once it is loaded.
    So `requests` = all hits, `warm_rate` = requests that found their adapter in memory,
    `slot_rate` = requests that found it already in a device slot."""
    if not counters:
        return None
    hits = {tier: int(n) for tier, n in (counters.get("hits") or {}).items()}
    requests = sum(hits.values())
    misses = int(counters.get("misses") or 0)
    if not requests and not misses:
        return None
    cold = min(misses, requests)
    return {
        "requests": requests, "misses": misses,
        "hits": {"device": hits.get("device", 0), "host": hits.get("host", 0)},
        "warm_rate": (requests - cold) / requests if requests else None,
        "slot_rate": hits.get("device", 0) / requests if requests else None,
        "loads": int(counters.get("loads") or 0), "load_failures": int(counters.get("load_failures") or 0),
        "evictions": {tier: int((counters.get("evictions") or {}).get(tier, 0)) for tier in ("device", "host")},
    }


def prefix_rates(counters: dict | None) -> dict | None:
    """The KV prefix cache since the worker started, in prompt tokens: looked up, found (not
    computed again) and their ratio; None before any prompt was looked up."""
    queries = int((counters or {}).get("prefix_queries") or 0)
    if not queries:
        return None
    hits = min(int(counters.get("prefix_hits") or 0), queries)
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries}


def _sum_counters(many: list[dict]) -> dict:
    total: dict = {"hits": Counter(), "evictions": Counter()}
    for counters in many:
        for key, value in counters.items():
            if isinstance(value, dict):
                total.setdefault(key, Counter()).update({k: int(v) for k, v in value.items()})
            else:
                total[key] = total.get(key, 0) + int(value)
    return {key: dict(value) if isinstance(value, Counter) else value for key, value in total.items()}


# -- adapters ---------------------------------------------------------------------------------
_ADAPTER_SUMS = ("requests", "errors", "prompt_tokens", "completion_tokens")


def top_adapters(*, start: datetime, end: datetime, limit: int = 20) -> dict:
    """The adapters with the most tokens over requests started in [start, end): per adapter
    (its model id `tenant/name`, every version and `@vN` id it was called by folded in), its
    requests, errors, tokens and how many of its versions served them.

    From the usage roll-ups' "version" rows (requests that ran on an adapter version; key "" is
    the base model): the coarsest rows that fit inside the range (timeseries' cover: day rows
    for whole days, hour and minute rows at the edges) summed per version, and the ledger for
    what no roll-up holds (the edges under a minute, the live tail since the last roll-up run).
    So a 30-day range reads ~30 day rows per version instead of a month of ledger rows."""
    per_version: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(_ADAPTER_SUMS, 0))
    segments = _cover(start, end, tuple(WIDTHS))
    rolled = _segments_q([segment for segment in segments if segment[0] is not None])
    if rolled is not None:
        rows = (UsageRollup.objects.filter(rolled, dimension=Dimension.VERSION).exclude(key="")
                .values("key").annotate(**{name: Sum(name) for name in _ADAPTER_SUMS}).order_by())
        for row in rows:
            for name in _ADAPTER_SUMS:
                per_version[int(row["key"])][name] += row[name]
    for _, lower, upper in (segment for segment in segments if segment[0] is None):
        rows = (UsageRecord.objects.filter(created_at__gte=lower, created_at__lt=upper, adapter_version__isnull=False)
                .values("adapter_version_id")
                .annotate(requests=Count("id"), errors=Count("id", filter=ERROR_Q),
                          prompt_tokens=Sum("prompt_tokens"), completion_tokens=Sum("completion_tokens"))
                .order_by())
        for row in rows:
            for name in _ADAPTER_SUMS:
                per_version[row["adapter_version_id"]][name] += row[name] or 0
    per_adapter: dict[int, dict] = {}
    versions = AdapterVersion.objects.filter(pk__in=per_version).select_related("adapter__tenant")
    for version in versions:
        adapter = version.adapter
        entry = per_adapter.setdefault(adapter.pk, {
            "model": adapter.public_id, "tenant": adapter.tenant.slug, **dict.fromkeys(_ADAPTER_SUMS, 0),
            "total_tokens": 0, "versions": 0})
        sums = per_version[version.pk]
        for name in _ADAPTER_SUMS:
            entry[name] += sums[name]
        entry["total_tokens"] += sums["prompt_tokens"] + sums["completion_tokens"]
        entry["versions"] += 1
    adapters = list(per_adapter.values())
    adapters.sort(key=lambda a: (-a["total_tokens"], -a["requests"], a["model"]))
    return {"start": start.isoformat(), "end": end.isoformat(), "adapters": adapters[:limit]}


# -- billing ----------------------------------------------------------------------------------
def billing_totals(*, year: int, month: int, now: datetime | None = None) -> dict:
    """Every tenant's statement total for a UTC month, and the sum: what statement_for
    (portal.usage.billing) bills, to the digit, summed from the usage roll-ups and the ledger's
    live tail (timeseries.usage_totals) rather than from 50 statements over a month of ledger rows
    (2 s and 11 s on 2M rows a month, bench/dashboards.py). A statement's cost is linear in its
    token sums at the plan's prices, so per-tenant sums price exactly as its per-model lines do."""
    start, end = month_bounds(year, month)
    now = now or timezone.now()
    tenants: list[dict] = []
    if start < now:
        month_range = TimeRange(start=start, end=min(end, now), bucket=BUCKETS["1d"], name="custom")
        tenants = [{"slug": t["slug"], "name": t["name"], "plan": t["plan"], "requests": t["billed_requests"],
                    "prompt_tokens": t["prompt_tokens"], "completion_tokens": t["completion_tokens"],
                    "total_tokens": t["total_tokens"], "cost": _cost(t["plan"], t["prompt_tokens"], t["completion_tokens"])}
                   for t in usage_totals(time_range=month_range)["tenants"] if t["billed_requests"]]
    total = sum((t["cost"] for t in tenants), Decimal(0))
    tenants.sort(key=lambda t: (-t["cost"], t["slug"]))
    return {"month": f"{year:04d}-{month:02d}", "tenants": [{**t, "cost": money(t["cost"])} for t in tenants],
            "total_tokens": sum(t["total_tokens"] for t in tenants), "total_cost": money(total)}


def _cost(plan_name: str, prompt_tokens: int, completion_tokens: int) -> Decimal:
    plan = plan_for(plan_name)
    return (token_cost(prompt_tokens, plan.prompt_price_per_million)
            + token_cost(completion_tokens, plan.completion_price_per_million))

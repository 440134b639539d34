"""Reads for the staff dashboards: the fleet as the last poll saw it (portal.fleet), and the
usage ledger (portal.usage) summed per tenant, per adapter and per day. JSON-ready dicts only.

Quota rejections are the ledger's 429 rows: the gateway (and the playground) write one usage
row with status 429 for every request quota admission refused.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from datetime import UTC, date, timedelta
from decimal import Decimal

from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncDate

from portal.fleet.models import InferenceWorker, WorkerDiscovery
from portal.tenants.models import Tenant
from portal.tenants.plans import plan_for
from portal.usage.billing import money, statement_for, token_cost
from portal.usage.models import COMPLETED_Q, ERROR_Q, UsageRecord
from portal.usage.percentiles import (
    PERCENTILES,
    PercentileCont,
    database_has_percentile_cont,
    percentile_cont,
)
from portal.usage.periods import days_bounds

MEMORY_KINDS = ("base_weights", "kv_cache", "adapter_slots", "host_adapters")
TIERS = ("device", "host", "loading", "disk", "failed")
QUOTA_REJECTED = Q(status_code=429)
_P = {f"p{round(p * 100)}": p for p in PERCENTILES}
_METRICS = {"ttft_ms": "time_to_first_token_ms", "latency_ms": "latency_ms"}


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


# -- tenants ----------------------------------------------------------------------------------
def _cost(tenant: Tenant, prompt: int, completion: int) -> Decimal:
    plan = plan_for(tenant.plan)
    return token_cost(prompt, plan.prompt_price_per_million) + token_cost(completion, plan.completion_price_per_million)


def tenants_summary(*, start: date, end: date) -> dict:
    """Per tenant over days [start, end]: requests, errors, quota rejections (429 rows), client
    disconnects, tokens and spend at the tenant's plan prices; busiest first."""
    lower, upper = days_bounds(start, end)
    rows = (UsageRecord.objects.filter(created_at__gte=lower, created_at__lt=upper)
            .values("tenant_id")
            .annotate(requests=Count("id"), errors=Count("id", filter=ERROR_Q),
                      quota_rejections=Count("id", filter=QUOTA_REJECTED),
                      disconnects=Count("id", filter=Q(client_disconnected=True)),
                      prompt_tokens=Sum("prompt_tokens"), completion_tokens=Sum("completion_tokens"))
            .order_by())
    by_tenant = {row["tenant_id"]: row for row in rows}
    tenants = []
    for tenant in Tenant.objects.filter(pk__in=by_tenant):
        row = by_tenant[tenant.pk]
        prompt, completion = row["prompt_tokens"] or 0, row["completion_tokens"] or 0
        tenants.append({
            "slug": tenant.slug, "name": tenant.name, "plan": tenant.plan, "status": tenant.status,
            "requests": row["requests"], "errors": row["errors"], "quota_rejections": row["quota_rejections"],
            "disconnects": row["disconnects"], "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "spend": money(_cost(tenant, prompt, completion)),
        })
    tenants.sort(key=lambda t: (-t["total_tokens"], -t["requests"], t["slug"]))
    return {"start": start.isoformat(), "end": end.isoformat(), "tenants": tenants}


# -- latency ----------------------------------------------------------------------------------
def latency_series(*, start: date, end: date, tenant: str | None = None, model: str | None = None) -> dict:
    """TTFT and total latency p50/p95/p99 (ms) per UTC day over completed requests, optionally
    for one tenant (slug) and/or one model id; days without requests have None."""
    lower, upper = days_bounds(start, end)
    records = UsageRecord.objects.filter(COMPLETED_Q, created_at__gte=lower, created_at__lt=upper)
    if tenant:
        records = records.filter(tenant__slug=tenant)
    if model:
        records = records.filter(model=model)
    records = records.annotate(day=TruncDate("created_at", tzinfo=UTC))
    found: dict[date, dict] = {}
    if database_has_percentile_cont():
        rows = records.values("day").annotate(requests=Count("id"), **{
            f"{metric}__{name}": PercentileCont(column, p)
            for metric, column in _METRICS.items() for name, p in _P.items()}).order_by("day")
        for row in rows:
            found[row["day"]] = {"requests": row["requests"], **{
                metric: {name: row[f"{metric}__{name}"] for name in _P} for metric in _METRICS}}
    else:
        values: dict[date, list[tuple]] = defaultdict(list)
        for day, ttft, latency in records.values_list("day", "time_to_first_token_ms", "latency_ms"):
            values[day].append((ttft, latency))
        for day, pairs in values.items():
            found[day] = {"requests": len(pairs), **{
                metric: {name: percentile_cont([pair[i] for pair in pairs], p) for name, p in _P.items()}
                for i, metric in enumerate(_METRICS)}}
    days = []
    day = start
    empty = {"requests": 0, **{metric: dict.fromkeys(_P) for metric in _METRICS}}
    while day <= end:
        days.append({"date": day.isoformat(), **found.get(day, empty)})
        day += timedelta(days=1)
    return {"start": start.isoformat(), "end": end.isoformat(), "tenant": tenant, "model": model,
            "requests": sum(day["requests"] for day in days), "days": days}


def latency_filters(*, start: date, end: date) -> dict:
    """The tenants and models with requests in [start, end], for the latency page's pickers."""
    lower, upper = days_bounds(start, end)
    records = UsageRecord.objects.filter(created_at__gte=lower, created_at__lt=upper)
    return {"tenants": sorted(set(records.values_list("tenant__slug", flat=True))),
            "models": sorted(set(records.values_list("model", flat=True)) - {""})}


# -- adapters ---------------------------------------------------------------------------------
def top_adapters(*, start: date, end: date, limit: int = 20) -> dict:
    """The adapters (model ids served by an adapter version) with the most tokens in [start, end]."""
    lower, upper = days_bounds(start, end)
    rows = (UsageRecord.objects.filter(created_at__gte=lower, created_at__lt=upper, adapter_version__isnull=False)
            .values("model", "tenant__slug")
            .annotate(requests=Count("id"), errors=Count("id", filter=ERROR_Q),
                      prompt_tokens=Sum("prompt_tokens"), completion_tokens=Sum("completion_tokens"),
                      versions=Count("adapter_version_id", distinct=True))
            .order_by())
    adapters = [{
        "model": row["model"], "tenant": row["tenant__slug"], "requests": row["requests"], "errors": row["errors"],
        "prompt_tokens": row["prompt_tokens"] or 0, "completion_tokens": row["completion_tokens"] or 0,
        "total_tokens": (row["prompt_tokens"] or 0) + (row["completion_tokens"] or 0), "versions": row["versions"],
    } for row in rows]
    adapters.sort(key=lambda a: (-a["total_tokens"], -a["requests"], a["model"]))
    return {"start": start.isoformat(), "end": end.isoformat(), "adapters": adapters[:limit]}


# -- billing ----------------------------------------------------------------------------------
def billing_totals(*, year: int, month: int) -> dict:
    """Every tenant's statement total for a UTC month (portal.usage.billing), and the sum."""
    tenants = []
    total = Decimal(0)
    tokens = 0
    for tenant in Tenant.objects.order_by("slug"):
        statement = statement_for(tenant=tenant, year=year, month=month)
        if not statement.lines:
            continue
        total += statement.total_cost
        tokens += statement.total_tokens
        tenants.append({"slug": tenant.slug, "name": tenant.name, "plan": statement.plan,
                        "requests": statement.requests, "prompt_tokens": statement.prompt_tokens,
                        "completion_tokens": statement.completion_tokens, "total_tokens": statement.total_tokens,
                        "cost": money(statement.total_cost)})
    tenants.sort(key=lambda t: (-Decimal(t["cost"]), t["slug"]))
    return {"month": f"{year:04d}-{month:02d}", "tenants": tenants, "total_tokens": tokens, "total_cost": money(total)}

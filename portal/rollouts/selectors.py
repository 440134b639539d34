"""Reads for safe rollouts: versions side by side, a canary's figures, the rollback banner.

Where the numbers come from:
- Over the chosen window, per version (version_comparison's "versions"): counts and token sums
  and EXACT p50/p95 of TTFT and inter-token gaps over the window's completed requests, from the
  ledger (percentiles over a window do not add up from buckets), one grouped query per kind.
- Per bucket (its "series"): portal.usage.timeseries.latency_series filtered by version, i.e.
  the UsageRollup rows of dimension "version" and the ledger for the live tail.
- A canary's figures (canary_figures): the ledger since the canary's weight was last set.
Everything is scoped by the adapter, which the caller got from its tenant (adapter_get).
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime

from django.db.models import Count, Q, Sum

from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment
from portal.core.ranges import TimeRange
from portal.rollouts.models import CanaryGuard, Feedback
from portal.tenants.models import Tenant
from portal.usage.models import COMPLETED_Q, ERROR_Q, UsageRecord
from portal.usage.percentiles import PercentileCont, database_has_percentile_cont, percentile_cont
from portal.usage.timeseries import latency_series

WEIGHTS_SET = "deployment.weights_set"
ROLLED_BACK = "deployment.canary_rolled_back"


# -- feedback ---------------------------------------------------------------------------------
def completion_record_get(*, tenant: Tenant, completion_id: str) -> UsageRecord | None:
    """The tenant's ledger row of the completion the client knows as `completion_id`."""
    return (UsageRecord.objects.filter(tenant=tenant, completion_id=completion_id)
            .order_by("-created_at").first())


def feedback_counts(*, version_ids: list[int], start: datetime, end: datetime) -> dict[int, dict[str, int]]:
    """{version id: {"up": n, "down": n}} of feedback given in [start, end)."""
    counts: dict[int, dict[str, int]] = {pk: {"up": 0, "down": 0} for pk in version_ids}
    rows = (Feedback.objects.filter(adapter_version_id__in=version_ids, created_at__gte=start, created_at__lt=end)
            .values("adapter_version_id", "rating").annotate(n=Count("id")).order_by())
    for row in rows:
        counts[row["adapter_version_id"]][row["rating"]] = row["n"]
    return counts


# -- the deployment's versions ----------------------------------------------------------------
def deployment_roles(*, deployment: Deployment) -> tuple[int | None, list[int]]:
    """(the serving version's number, the canaries' numbers): the serving one has the largest
    weight (the newer on a tie); canaries have a weight > 0 below it. No weights: no canary."""
    weighted = {int(n): w for n, w in (deployment.weights or {}).items() if w > 0}
    if not weighted:
        return None, []
    stable = max(weighted, key=lambda n: (weighted[n], n))
    return stable, sorted(n for n, w in weighted.items() if w < weighted[stable])


def canary_window_start(*, deployment: Deployment, number: int) -> datetime:
    """When version `number`'s weight was last set to what it is now: the newest audited
    weights change that changed it (the deployment's last update when none is on record)."""
    events = AuditEvent.objects.filter(tenant_id=deployment.adapter.tenant_id, action=WEIGHTS_SET,
                                       target=deployment.adapter.public_id).order_by("-created_at", "-id")
    key = str(number)
    for event in events.only("details", "created_at")[:200]:
        details = event.details or {}
        if (details.get("weights") or {}).get(key) != (details.get("previous") or {}).get(key):
            return event.created_at
    return deployment.updated_at


def canary_figures(*, version: AdapterVersion, since: datetime) -> dict:
    """The version's requests, errors, error rate and TTFT p95 (completed requests) since `since`."""
    rows = UsageRecord.objects.filter(adapter_version=version, created_at__gte=since)
    counts = rows.aggregate(requests=Count("id"), errors=Count("id", filter=ERROR_Q))
    completed = rows.filter(COMPLETED_Q, time_to_first_token_ms__isnull=False)
    if database_has_percentile_cont():
        p95 = completed.aggregate(p95=PercentileCont("time_to_first_token_ms", 0.95))["p95"]
    else:
        p95 = percentile_cont(completed.values_list("time_to_first_token_ms", flat=True), 0.95)
    requests = counts["requests"]
    return {"version": version.number, "requests": requests, "errors": counts["errors"],
            "error_rate": counts["errors"] / requests if requests else None, "ttft_p95_ms": p95}


def canary_guard_get(*, deployment: Deployment) -> CanaryGuard:
    """The deployment's guard with its defaults (made on first use)."""
    return CanaryGuard.objects.get_or_create(deployment=deployment)[0]


def guarded_deployments():
    """Deployments whose guard is on (or was never configured: on by default) with weights set."""
    return (Deployment.objects.exclude(weights={}).exclude(canary_guard__enabled=False)
            .select_related("adapter__tenant").order_by("pk"))


def rollback_banner(*, adapter: Adapter) -> dict | None:
    """The last automatic rollback of the adapter's canary, while it still applies: not
    dismissed, and no weights set since (the rollback's own change excepted)."""
    guard = CanaryGuard.objects.filter(deployment__adapter=adapter, rolled_back_at__isnull=False,
                                       banner_dismissed=False).first()
    if guard is None or guard.rollback_event_id is None:
        return None
    newer = AuditEvent.objects.filter(tenant_id=adapter.tenant_id, action=WEIGHTS_SET, target=adapter.public_id,
                                      pk__gt=guard.rollback_event_id).exists()
    if newer:
        return None
    return {"at": guard.rolled_back_at, **guard.rollback_figures}


# -- the per-version comparison ---------------------------------------------------------------
def deployment_weights(*, adapter: Adapter) -> dict[int, int]:
    """{version number: weight} of the adapter's deployment ({} when none is set)."""
    weights = Deployment.objects.filter(adapter=adapter).values_list("weights", flat=True).first() or {}
    return {int(n): w for n, w in weights.items()}


def compared_versions(*, adapter: Adapter, time_range: TimeRange) -> list[AdapterVersion]:
    """The versions to show: those with a weight > 0 now, and those that served requests in the range."""
    weighted = {n for n, w in deployment_weights(adapter=adapter).items() if w > 0}
    served = set(UsageRecord.objects.filter(tenant_id=adapter.tenant_id, adapter_version__adapter=adapter,
                                            created_at__gte=time_range.start, created_at__lt=time_range.end)
                 .values_list("adapter_version_id", flat=True).order_by().distinct())
    return list(adapter.versions.filter(Q(number__in=weighted) | Q(pk__in=served)).order_by("number"))


def version_window_figures(*, version_ids: list[int], start: datetime, end: datetime) -> dict[int, dict]:
    """Per version over [start, end), from the ledger: requests, errors, tokens, and the exact
    p50/p95 of TTFT and inter-token gap over completed requests (None without any)."""
    rows = UsageRecord.objects.filter(adapter_version_id__in=version_ids, created_at__gte=start, created_at__lt=end)
    figures: dict[int, dict] = {pk: {"requests": 0, "errors": 0, "prompt_tokens": 0, "completion_tokens": 0,
                                     "ttft_p50_ms": None, "ttft_p95_ms": None, "itl_p50_ms": None,
                                     "itl_p95_ms": None} for pk in version_ids}
    for row in (rows.values("adapter_version_id").annotate(
            requests=Count("id"), errors=Count("id", filter=ERROR_Q), prompt_tokens=Sum("prompt_tokens"),
            completion_tokens=Sum("completion_tokens")).order_by()):
        figures[row.pop("adapter_version_id")].update(row)
    completed = rows.filter(COMPLETED_Q)
    timings = {"ttft": "time_to_first_token_ms", "itl": "inter_token_ms"}
    if database_has_percentile_cont():
        for name, column in timings.items():
            for row in (completed.filter(**{f"{column}__isnull": False}).values("adapter_version_id")
                        .annotate(p50=PercentileCont(column, 0.5), p95=PercentileCont(column, 0.95)).order_by()):
                figures[row["adapter_version_id"]].update({f"{name}_p50_ms": row["p50"], f"{name}_p95_ms": row["p95"]})
    else:
        values: dict[tuple[int, str], list[float]] = defaultdict(list)
        for pk, ttft, itl in completed.values_list("adapter_version_id", "time_to_first_token_ms", "inter_token_ms"):
            values[(pk, "ttft")].append(ttft)
            values[(pk, "itl")].append(itl)
        for (pk, name), found in values.items():
            figures[pk][f"{name}_p50_ms"] = percentile_cont(found, 0.5)
            figures[pk][f"{name}_p95_ms"] = percentile_cont(found, 0.95)
    return figures


def version_comparison(*, adapter: Adapter, time_range: TimeRange) -> dict:
    """The adapter's serving versions side by side over the range (a table row each) and per
    bucket (a chart per metric): JSON-ready."""
    versions = compared_versions(adapter=adapter, time_range=time_range)
    ids = [v.pk for v in versions]
    figures = version_window_figures(version_ids=ids, start=time_range.start, end=time_range.end)
    feedback = feedback_counts(version_ids=ids, start=time_range.start, end=time_range.end)
    weights = deployment_weights(adapter=adapter)
    total = sum(f["requests"] for f in figures.values())
    rows, series = [], []
    for version in versions:
        f = figures[version.pk]
        requests = f["requests"]
        rows.append({
            "id": version.pk, "number": version.number, "label": f"v{version.number}",
            "weight": weights.get(version.number, 0), **f,
            "error_rate": f["errors"] / requests if requests else None,
            "tokens_per_request": (f["prompt_tokens"] + f["completion_tokens"]) / requests if requests else None,
            "share": requests / total if total else None,
            "feedback_up": feedback[version.pk]["up"], "feedback_down": feedback[version.pk]["down"],
        })
        buckets = latency_series(time_range=time_range, version=version.pk)["buckets"]
        series.append({"label": f"v{version.number}", "buckets": [_point(b) for b in buckets]})
    starts = [p["start"] for p in series[0]["buckets"]] if series else []
    return {"range": time_range.as_json(), "versions": rows, "starts": starts,
            "series": [{"label": s["label"], **{name: [p[name] for p in s["buckets"]] for name in _SERIES}}
                       for s in series]}


_SERIES = ("requests", "error_rate", "ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms", "tokens_per_request")


def _point(bucket: dict) -> dict:
    requests = bucket["requests"]
    return {
        "start": bucket["start"], "requests": requests,
        "error_rate": bucket["errors"] / requests if requests else None,
        "ttft_p50_ms": bucket["ttft_ms"]["p50"], "ttft_p95_ms": bucket["ttft_ms"]["p95"],
        "itl_p50_ms": bucket["itl_ms"]["p50"], "itl_p95_ms": bucket["itl_ms"]["p95"],
        "tokens_per_request": ((bucket["prompt_tokens"] + bucket["completion_tokens"]) / requests
                               if requests else None),
    }

"""Predictive prewarm: before an hour starts, stage the adapters the ledger says will be busy in
it onto the workers that do not hold them yet, so their first request finds them in memory.

Score per adapter (portal.usage UsageRecord rows with an adapter version):
    requests in the coming hour-of-day window on each of the last PREWARM_DAYS days
    ([now + d·(-1 day), +1 h) for d = 1..7: yesterday's, the day before's ... same hour)
  + requests in the last hour (what is busy right now stays warm)
The top ADAPTER_PREWARM_TOP_N adapters (default 8; a worker that reports its host-tier size
gets at most that many) have their deployed versions staged (portal.adapters.staging) on each
enabled, healthy worker where the last fleet poll did not see them resident.

prewarm_task (portal.adapters.tasks) runs hourly on Celery beat: call register_beat(app) once at
start-up (portal/adapters/apps.py ready(), like portal.fleet does) to add the entry.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q
from django.utils import timezone

from portal.adapters import staging
from portal.adapters.models import Adapter, AdapterVersion
from portal.adapters.traffic import deployed_versions
from portal.fleet.models import InferenceWorker
from portal.usage.models import UsageRecord

logger = logging.getLogger(__name__)

PREWARM_DAYS = 7
PREWARM_TASK = "portal.adapters.prewarm.prewarm_task"  # its registered name (portal.adapters.tasks)
BEAT_SCHEDULE = {
    "adapters-prewarm": {
        "task": PREWARM_TASK,
        "schedule": 3600.0,
        "options": {"expires": 1800.0},  # a prewarm an hour late is worthless
    },
}


@dataclass(frozen=True)
class PrewarmPlan:
    scores: dict[int, int]  # adapter id -> expected requests
    staged: dict[str, list[str]]  # worker url -> worker names enqueued for staging


def prewarm_scores(*, now: datetime | None = None, days: int = PREWARM_DAYS) -> Counter[int]:
    """{adapter id: requests} over the same coming hour on the last `days` days plus the last hour."""
    now = now or timezone.now()
    window = Q(created_at__gte=now - timedelta(hours=1), created_at__lt=now)
    for d in range(1, days + 1):
        start = now - timedelta(days=d)
        window |= Q(created_at__gte=start, created_at__lt=start + timedelta(hours=1))
    rows = (
        UsageRecord.objects.filter(window, adapter_version__isnull=False)
        .values("adapter_version__adapter_id")
        .annotate(n=Count("id"))
    )
    return Counter({row["adapter_version__adapter_id"]: row["n"] for row in rows})


def prewarm(*, now: datetime | None = None, top_n: int | None = None) -> PrewarmPlan:
    """Stage the expected-busy adapters' deployed versions where they are not resident."""
    top_n = int(top_n if top_n is not None else settings.ADAPTER_PREWARM_TOP_N)
    scores = prewarm_scores(now=now)
    ranked = [adapter_id for adapter_id, _ in sorted(scores.items(), key=lambda kv: (-kv[1], kv[0]))][:top_n]
    adapters = Adapter.objects.select_related("tenant").in_bulk(ranked)
    versions: list[AdapterVersion] = []
    for adapter_id in ranked:
        adapter = adapters.get(adapter_id)
        if adapter is not None and adapter.tenant.is_active:
            versions += deployed_versions(adapter=adapter)
    workers = list(InferenceWorker.objects.filter(enabled=True, healthy=True).order_by("url"))
    staged: dict[str, list[str]] = {}
    by_version: dict[int, list[str]] = {}
    for worker in workers:
        cap = (worker.base_config or {}).get("max_cpu_loras")
        wanted = versions[:cap] if isinstance(cap, int) and cap > 0 else versions
        for version in wanted:
            if not worker.has_resident(version.worker_name):
                by_version.setdefault(version.pk, []).append(worker.url)
    for version in versions:
        urls = by_version.get(version.pk)
        if urls:
            for url in staging.version_stage_enqueue(version=version, worker_urls=urls):
                staged.setdefault(url, []).append(version.worker_name)
    if staged:
        logger.info("prewarm: %s", {url: len(names) for url, names in staged.items()})
    return PrewarmPlan(scores=dict(scores), staged=staged)


def register_beat(app) -> None:
    """Add the hourly prewarm to a Celery app's beat schedule (call from an AppConfig.ready)."""
    app.conf.beat_schedule = {**(app.conf.beat_schedule or {}), **BEAT_SCHEDULE}

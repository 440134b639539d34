"""Celery tasks of the usage app (the beat entry is added in apps.UsageConfig.ready)."""

from __future__ import annotations

from datetime import date

from celery import shared_task

from portal.usage.rollups import usage_rollup_prune, usage_rollup_refresh
from portal.usage.services import usage_rollup_day, usage_rollup_recent
from portal.usage.spool import usage_spool_replay


@shared_task(name="portal.usage.tasks.usage_rollup_task")
def usage_rollup_task(day: str | None = None) -> list[str]:
    """Roll up one UTC day ("YYYY-MM-DD"), or yesterday and today without one (the hourly beat)."""
    if day is not None:
        usage_rollup_day(day=date.fromisoformat(day))
        return [day]
    return [rolled.isoformat() for rolled in usage_rollup_recent()]


@shared_task(name="portal.usage.tasks.usage_spool_replay_task")
def usage_spool_replay_task() -> dict[str, int]:
    """Write back ledger rows spooled while the database was unreachable (beat, every 30 s)."""
    return usage_spool_replay()


@shared_task(name="portal.usage.tasks.usage_rollup_refresh_task")
def usage_rollup_refresh_task() -> dict[str, int]:
    """Recompute the minute/hour/day roll-up buckets that got ledger rows (beat, every minute);
    {granularity: buckets recomputed}."""
    return {result.granularity: result.buckets for result in usage_rollup_refresh()}


@shared_task(name="portal.usage.tasks.usage_rollup_prune_task")
def usage_rollup_prune_task() -> dict[str, int]:
    """Delete roll-up rows past their retention (beat, hourly); {granularity: rows deleted}."""
    return usage_rollup_prune()

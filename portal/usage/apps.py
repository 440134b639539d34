from celery.schedules import crontab
from django.apps import AppConfig

from portal.celery import app

# Hourly, a few minutes past the hour: rebuild today's and yesterday's DailyUsage (yesterday
# too, so requests that started before midnight and finished after are counted).
BEAT_SCHEDULE = {
    "usage-rollup-hourly": {
        "task": "portal.usage.tasks.usage_rollup_task",
        "schedule": crontab(minute=5),
        "options": {"expires": 50 * 60},
    },
    # The dashboards' minute/hour/day roll-ups (portal.usage.rollups): every minute, so that
    # only the last minute or two is read from the ledger at query time.
    "usage-rollup-refresh": {
        "task": "portal.usage.tasks.usage_rollup_refresh_task",
        "schedule": 60.0,
        "options": {"expires": 55},
    },
    "usage-rollup-prune": {
        "task": "portal.usage.tasks.usage_rollup_prune_task",
        "schedule": crontab(minute=17),
        "options": {"expires": 50 * 60},
    },
    # Ledger rows spooled while PostgreSQL was unreachable (portal.usage.spool) go back in
    # within half a minute of it returning.
    "usage-spool-replay": {
        "task": "portal.usage.tasks.usage_spool_replay_task",
        "schedule": 30.0,
        "options": {"expires": 25},
    },
}


class UsageConfig(AppConfig):
    name = "portal.usage"
    label = "usage"
    verbose_name = "Usage and billing"

    def ready(self) -> None:
        # Joins the beat schedule from here (as portal.fleet does), merging with what other
        # apps added; `celery beat` runs Django's setup before it reads the schedule.
        app.conf.beat_schedule = {**(app.conf.beat_schedule or {}), **BEAT_SCHEDULE}
        # /metrics reads the spool replay's totals (kept in Redis by whichever process replays).
        from portal.core.metrics import LEDGER_WRITES
        from portal.usage.spool import usage_spool_replay_totals

        LEDGER_WRITES.replay_totals = usage_spool_replay_totals

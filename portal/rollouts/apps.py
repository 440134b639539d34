from django.apps import AppConfig

from portal.celery import app

# Every minute: judge each deployment's canaries against the serving version (portal.rollouts.tasks).
BEAT_SCHEDULE = {
    "rollouts-canary-guard": {
        "task": "portal.rollouts.tasks.canary_guard_check_task",
        "schedule": 60.0,
        "options": {"expires": 55},
    },
}


class RolloutsConfig(AppConfig):
    name = "portal.rollouts"
    label = "rollouts"
    verbose_name = "Safe rollouts"

    def ready(self) -> None:
        # Joins the beat schedule from here (as portal.usage does), merging with the other apps'.
        app.conf.beat_schedule = {**(app.conf.beat_schedule or {}), **BEAT_SCHEDULE}

from django.apps import AppConfig

from portal.celery import app


class FleetConfig(AppConfig):
    name = "portal.fleet"
    label = "fleet"
    verbose_name = "Inference fleet"

    def ready(self) -> None:
        # The periodic poll joins the beat schedule from here, so portal/celery.py and the
        # settings need no fleet-specific lines. `celery beat` runs Django's setup (the Celery
        # Django fixup) before it reads the schedule, so this is in place by then. The tasks
        # module imports models, which Django loads only after every apps.py: hence here.
        from portal.fleet.tasks import BEAT_SCHEDULE

        app.conf.beat_schedule = {**(app.conf.beat_schedule or {}), **BEAT_SCHEDULE}
        # /metrics counts the workers by state at scrape time (portal.core.metrics imports no app).
        from portal.core.metrics import REGISTRY
        from portal.fleet.metrics import FleetWorkers

        REGISTRY.register(FleetWorkers())

from django.apps import AppConfig

from portal.celery import app


class AdaptersConfig(AppConfig):
    name = "portal.adapters"
    label = "adapters"
    verbose_name = "Adapters"

    def ready(self) -> None:
        # Django's rule: an app's modules that touch models load once the registry is ready, so
        # here and not at the top. The tasks module registers the app's Celery tasks (services
        # start them by name); prewarm puts the hourly entry on the beat schedule; reconcile
        # listens to the fleet poll (a worker that lacks deployed adapters gets them staged).
        from portal.adapters import prewarm, reconcile, tasks  # noqa: F401
        from portal.fleet.signals import fleet_polled

        prewarm.register_beat(app)
        fleet_polled.connect(reconcile.on_fleet_polled, dispatch_uid="adapters.reconcile")

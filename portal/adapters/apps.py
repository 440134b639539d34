from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "portal.adapters"
    label = "adapters"
    verbose_name = "Adapters"

    def ready(self) -> None:
        # Import the modules that define Celery tasks so a worker process registers them, and
        # put the hourly predictive prewarm on the beat schedule.
        from portal.adapters import prewarm, staging, tasks  # noqa: F401
        from portal.celery import app

        prewarm.register_beat(app)

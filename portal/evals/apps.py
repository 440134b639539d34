from django.apps import AppConfig


class EvalsConfig(AppConfig):
    name = "portal.evals"
    label = "evals"
    verbose_name = "Evaluations"

    def ready(self) -> None:
        # Registers the run task (services start it by name, portal.core.jobs).
        from portal.evals import tasks  # noqa: F401

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "portal.fleet"
    label = "fleet"
    verbose_name = "Inference fleet"

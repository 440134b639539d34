from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "portal.adapters"
    label = "adapters"
    verbose_name = "Adapters"

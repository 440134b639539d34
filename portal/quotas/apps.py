from django.apps import AppConfig


class QuotasConfig(AppConfig):
    name = "portal.quotas"
    label = "quotas"
    verbose_name = "Quotas"

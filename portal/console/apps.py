from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    """The tenant portal: server-rendered pages over the other apps' services and selectors."""

    name = "portal.console"
    label = "console"
    verbose_name = "Tenant portal"

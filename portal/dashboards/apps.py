from django.apps import AppConfig


class DashboardsConfig(AppConfig):
    name = "portal.dashboards"
    label = "dashboards"
    verbose_name = "Admin dashboards"

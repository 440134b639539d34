from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "portal.gateway"
    label = "gateway"
    verbose_name = "API gateway"

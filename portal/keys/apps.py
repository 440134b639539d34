from django.apps import AppConfig


class KeysConfig(AppConfig):
    name = "portal.keys"
    label = "keys"
    verbose_name = "API keys"

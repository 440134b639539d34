from django.apps import AppConfig


class PlaygroundConfig(AppConfig):
    name = "portal.playground"
    label = "playground"
    verbose_name = "Playground"

from django.apps import AppConfig


class DemoConfig(AppConfig):
    """The demo data `make run` creates (manage.py bootstrap_demo): a staff user, a tenant, an API
    key and the repository's demo adapters. An app of its own because it writes across the others
    (tenants, keys, adapters), which portal.core must never import."""

    name = "portal.demo"
    label = "demo"
    verbose_name = "Demo data"

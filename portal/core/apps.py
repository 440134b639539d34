from pathlib import Path

from django.apps import AppConfig
from django.conf import settings

from portal import celery  # noqa: F401 -- makes the Celery app current, so @shared_task binds to it


class CoreConfig(AppConfig):
    name = "portal.core"
    label = "core"
    verbose_name = "Portal core"

    def ready(self) -> None:
        # SQLite does not create its parent directory; uploads need their root; whitenoise
        # warns at start-up when STATIC_ROOT is missing (before the first collectstatic).
        database = settings.DATABASES["default"]
        if database["ENGINE"] == "django.db.backends.sqlite3":
            Path(database["NAME"]).parent.mkdir(parents=True, exist_ok=True)
        for directory in (settings.STORAGE_ROOT, settings.STATIC_ROOT):
            Path(directory).mkdir(parents=True, exist_ok=True)

"""The Celery app: `celery -A portal.celery:app worker`.

Settings come from Django's (CELERY_* names): Redis broker when REDIS_URL is set, otherwise
tasks run eagerly inside the calling process. Tasks are found in each app's tasks.py.
"""

import os

from celery import Celery

from portal.config import load_config_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
load_config_or_exit(os.environ)

app = Celery("portal")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()

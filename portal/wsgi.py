"""WSGI entry point (management tools and plain WSGI servers); the portal runs under ASGI."""

import os

from portal.config import load_config_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
load_config_or_exit(os.environ)

from django.core.wsgi import get_wsgi_application  # noqa: E402 -- after the config check

application = get_wsgi_application()

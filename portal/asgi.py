"""ASGI entry point of the web process: `uvicorn portal.asgi:application`.

HTTP only for now; the playground issue adds a "websocket" route to the router.
"""

import os

from portal.config import load_config_or_exit

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
load_config_or_exit(os.environ)

from channels.routing import ProtocolTypeRouter  # noqa: E402 -- after the config check
from django.core.asgi import get_asgi_application  # noqa: E402

application = ProtocolTypeRouter({"http": get_asgi_application()})

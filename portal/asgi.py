"""ASGI entry point of the web process: `uvicorn portal.asgi:application`.

HTTP: Django; /v1/ (the OpenAI-compatible gateway) through its own handler without the portal's
middleware (portal.gateway.asgi); both handlers bound request bodies, and authenticate large
ones, before reading them (portal.core.body_guard). GET /metrics (Prometheus) is answered ahead
of both (portal.core.metrics_asgi). Websockets (the playground): the session's
user (AuthMiddlewareStack), only from an Origin in ALLOWED_HOSTS (AllowedHostsOriginValidator),
routed by portal.playground.routing.
"""

import os

from portal.config import load_config_or_exit, mark_web_process

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
# The web process pools its PostgreSQL connections (DATABASE_POOL_SIZE=0: one per request).
mark_web_process()
load_config_or_exit(os.environ)

import django  # noqa: E402 -- after the config check

django.setup(set_prefix=False)  # what get_asgi_application does, before anything imports models

from channels.auth import AuthMiddlewareStack  # noqa: E402
from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from channels.security.websocket import AllowedHostsOriginValidator  # noqa: E402

from portal.core.asgi_handler import PortalASGIHandler  # noqa: E402
from portal.core.metrics_asgi import route_metrics  # noqa: E402
from portal.gateway.asgi import route_gateway  # noqa: E402
from portal.keys.selectors import api_key_is_usable  # noqa: E402
from portal.playground.routing import websocket_urlpatterns  # noqa: E402

application = ProtocolTypeRouter({
    "http": route_metrics(route_gateway(PortalASGIHandler(api_key_is_usable=api_key_is_usable))),
    "websocket": AllowedHostsOriginValidator(AuthMiddlewareStack(URLRouter(websocket_urlpatterns))),
})

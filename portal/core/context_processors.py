from django.conf import settings
from django.http import HttpRequest


def debug_banner(request: HttpRequest) -> dict[str, bool]:
    """Every page warns when DEBUG is on (Django's own `debug` needs INTERNAL_IPS)."""
    return {"debug_banner": settings.DEBUG}

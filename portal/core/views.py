from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from portal.core.health import health_check_database, health_check_redis, health_check_static


@require_GET
def home(request: HttpRequest) -> HttpResponse:
    return render(request, "core/home.html")  # the user's tenants: context_processors.memberships


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    checks = {
        "database": health_check_database(),
        "redis": health_check_redis(settings.REDIS_URL),
        "static": health_check_static(),
    }
    healthy = all(check["ok"] for check in checks.values())
    return JsonResponse(
        {"status": "ok" if healthy else "degraded", "checks": checks},
        status=200 if healthy else 503,
    )

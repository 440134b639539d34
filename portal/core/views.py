from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from portal.core.health import health_check_database, health_check_redis
from portal.tenants.selectors import membership_list_for_user


@require_GET
def home(request: HttpRequest) -> HttpResponse:
    memberships = (
        membership_list_for_user(user=request.user) if request.user.is_authenticated else []
    )
    return render(request, "core/home.html", {"memberships": memberships})


@never_cache
@require_GET
def healthz(request: HttpRequest) -> JsonResponse:
    checks = {
        "database": health_check_database(),
        "redis": health_check_redis(settings.REDIS_URL),
    }
    healthy = all(check["ok"] for check in checks.values())
    return JsonResponse(
        {"status": "ok" if healthy else "degraded", "checks": checks},
        status=200 if healthy else 503,
    )

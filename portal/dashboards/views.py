"""Staff-only dashboards: server-rendered tables (they work without JavaScript) and the JSON
endpoints under /dashboards/api/ their charts read. Anonymous users are sent to the login page;
signed-in users who are not staff get a 404, as if the pages did not exist."""

from __future__ import annotations

import functools
import re
from datetime import date, timedelta

from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from portal.dashboards import selectors
from portal.usage.periods import utc_today

DEFAULT_DAYS = 14
MAX_DAYS = 366
MONTH = re.compile(r"^(\d{4})-(\d{2})$")


class BadParameter(ValueError):
    pass


def staff_only(view):
    @functools.wraps(view)
    def wrapper(request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        if not (request.user.is_active and request.user.is_staff):
            raise Http404("Not found.")
        try:
            return view(request, *args, **kwargs)
        except BadParameter as exc:
            if request.path.startswith("/dashboards/api/"):
                return JsonResponse({"error": {"message": str(exc)}}, status=400)
            return render(request, "dashboards/bad_request.html", {"message": str(exc)}, status=400)

    return require_GET(never_cache(wrapper))


def _period(request: HttpRequest) -> tuple[date, date, int]:
    raw = request.GET.get("days", str(DEFAULT_DAYS))
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_DAYS:
        raise BadParameter(f"days: a whole number from 1 to {MAX_DAYS}, got {raw[:20]!r}")
    days = int(raw)
    end = utc_today(timezone.now())
    return end - timedelta(days=days - 1), end, days


def _month(request: HttpRequest) -> tuple[int, int]:
    raw = request.GET.get("month")
    if not raw:
        today = utc_today(timezone.now())
        return today.year, today.month
    m = MONTH.match(raw)
    if not m or not 1 <= int(m[2]) <= 12 or int(m[1]) < 1:
        raise BadParameter(f"month: YYYY-MM, got {raw[:20]!r}")
    return int(m[1]), int(m[2])


def _text(request: HttpRequest, name: str) -> str | None:
    value = (request.GET.get(name) or "").strip()
    if len(value) > 300:
        raise BadParameter(f"{name}: too long")
    return value or None


# -- pages ------------------------------------------------------------------------------------
@staff_only
def fleet(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboards/fleet.html", {"section": "fleet", "fleet": selectors.fleet_overview()})


@staff_only
def tenants(request: HttpRequest) -> HttpResponse:
    start, end, days = _period(request)
    return render(request, "dashboards/tenants.html", {
        "section": "tenants", "days": days, "summary": selectors.tenants_summary(start=start, end=end)})


@staff_only
def latency(request: HttpRequest) -> HttpResponse:
    start, end, days = _period(request)
    tenant, model = _text(request, "tenant"), _text(request, "model")
    return render(request, "dashboards/latency.html", {
        "section": "latency", "days": days, "tenant": tenant, "model": model,
        "filters": selectors.latency_filters(start=start, end=end),
        "series": selectors.latency_series(start=start, end=end, tenant=tenant, model=model)})


@staff_only
def adapters(request: HttpRequest) -> HttpResponse:
    start, end, days = _period(request)
    return render(request, "dashboards/adapters.html", {
        "section": "adapters", "days": days, "top": selectors.top_adapters(start=start, end=end)})


@staff_only
def billing(request: HttpRequest) -> HttpResponse:
    year, month = _month(request)
    return render(request, "dashboards/billing.html", {
        "section": "billing", "totals": selectors.billing_totals(year=year, month=month)})


# -- JSON -------------------------------------------------------------------------------------
@staff_only
def fleet_json(request: HttpRequest) -> JsonResponse:
    return JsonResponse(selectors.fleet_overview())


@staff_only
def tenants_json(request: HttpRequest) -> JsonResponse:
    start, end, _ = _period(request)
    return JsonResponse(selectors.tenants_summary(start=start, end=end))


@staff_only
def latency_json(request: HttpRequest) -> JsonResponse:
    start, end, _ = _period(request)
    return JsonResponse(selectors.latency_series(start=start, end=end, tenant=_text(request, "tenant"),
                                                 model=_text(request, "model")))


@staff_only
def adapters_json(request: HttpRequest) -> JsonResponse:
    start, end, _ = _period(request)
    return JsonResponse(selectors.top_adapters(start=start, end=end))


@staff_only
def billing_json(request: HttpRequest) -> JsonResponse:
    year, month = _month(request)
    return JsonResponse(selectors.billing_totals(year=year, month=month))

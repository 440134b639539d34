"""Staff-only dashboards: server-rendered tables (they work without JavaScript) and the JSON
endpoints under /dashboards/api/ their charts read. Anonymous users are sent to the login page;
signed-in users who are not staff get a 404, as if the pages did not exist.

Every dashboard but billing (per month) takes a time range and a bucket (portal.core.ranges:
?range=15m|1h|...|custom&start=&end=&bucket=). The page passes its query string on to its JSON,
so a chart shows what the table under it shows; a live range (short, ending now) makes the page
fetch that JSON again every REFRESH_S seconds and redraw its charts in place."""

from __future__ import annotations

import functools
import re

from django.contrib.auth.views import redirect_to_login
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from portal.core.exceptions import InvalidInput
from portal.core.ranges import BUCKETS, RANGES, RangeError, TimeRange, parse_range
from portal.dashboards import selectors
from portal.fleet.models import InferenceWorker
from portal.fleet.selectors import fleet_history
from portal.usage import timeseries
from portal.usage.periods import utc_today

MONTH = re.compile(r"^(\d{4})-(\d{2})$")
REFRESH_S = 10  # how often a live page fetches its JSON again (the fleet is polled every 10 s)
RANGE_LABELS = {"15m": "last 15 minutes", "1h": "last hour", "6h": "last 6 hours", "24h": "last 24 hours",
                "7d": "last 7 days", "30d": "last 30 days", "custom": "custom (UTC)"}
BUCKET_LABELS = {"1m": "1 minute", "5m": "5 minutes", "15m": "15 minutes", "1h": "1 hour", "6h": "6 hours",
                 "1d": "1 day"}


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
        except (BadParameter, InvalidInput) as exc:  # InvalidInput: a filter the reads refused
            if request.path.startswith("/dashboards/api/"):
                return JsonResponse({"error": {"message": str(exc)}}, status=400)
            return render(request, "dashboards/bad_request.html", {"message": str(exc)}, status=400)

    return require_GET(never_cache(wrapper))


def _range(request: HttpRequest) -> TimeRange:
    try:
        return parse_range(request.GET, now=timezone.now())
    except RangeError as exc:
        raise BadParameter(str(exc)) from exc


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


def _worker(request: HttpRequest) -> InferenceWorker | None:
    """The fleet pages' ?worker=<id>: one registered worker, or all of them when absent."""
    raw = (request.GET.get("worker") or "").strip()
    if not raw:
        return None
    if not raw.isdigit() or len(raw) > 18:
        raise BadParameter(f"worker: a worker id (a whole number), got {raw[:20]!r}")
    worker = InferenceWorker.objects.filter(pk=int(raw)).first()
    if worker is None:
        raise BadParameter(f"worker: no worker has id {raw}")
    return worker


def _page(request: HttpRequest, section: str, time_range: TimeRange, filters: list[dict] | None = None) -> dict:
    """What _base.html and _range.html need: the range form (with this page's filter pickers),
    the query string the charts' JSON URLs carry, and whether the page refreshes itself."""
    params = request.GET.copy()
    for name in list(params):
        if not params.get(name):
            del params[name]
    query = params.urlencode()
    return {
        "section": section, "range": time_range.as_json(), "query": query,
        "refresh_s": REFRESH_S if time_range.live else None, "generated_at": timezone.now(),
        "range_choices": [(name, RANGE_LABELS[name]) for name in [*RANGES, "custom"]],
        "bucket_choices": [("", "auto"), *((name, BUCKET_LABELS[name]) for name in BUCKETS)],
        "custom_start": request.GET.get("start", "")[:40], "custom_end": request.GET.get("end", "")[:40],
        "chosen_bucket": request.GET.get("bucket", "")[:20], "filters": filters or [],
    }


def _picker(name: str, label: str, options: list[tuple[str, str]], selected: str | None) -> dict:
    return {"name": name, "label": label, "options": options, "selected": selected or ""}


# -- pages ------------------------------------------------------------------------------------
@staff_only
def fleet(request: HttpRequest) -> HttpResponse:
    """The fleet now (the last poll), then over the range: the poll kept as history."""
    time_range, worker = _range(request), _worker(request)
    workers = [(str(w.pk), str(w)) for w in InferenceWorker.objects.order_by("url")]
    history = fleet_history(time_range=time_range, worker=worker.pk if worker else None)
    return render(request, "dashboards/fleet.html", {
        **_page(request, "fleet", time_range, [_picker("worker", "Worker", workers, request.GET.get("worker"))]),
        "fleet": selectors.fleet_overview(), "history": history, "worker": worker})


@staff_only
def tenants(request: HttpRequest) -> HttpResponse:
    time_range = _range(request)
    return render(request, "dashboards/tenants.html", {
        **_page(request, "tenants", time_range),
        "summary": timeseries.usage_totals(time_range=time_range)})


@staff_only
def latency(request: HttpRequest) -> HttpResponse:
    time_range = _range(request)
    chosen = _latency_filters(request)
    found = timeseries.latency_filters(time_range=time_range)
    pickers = [
        _picker("tenant", "Tenant", [(slug, slug) for slug in found["tenants"]], chosen["tenant"]),
        _picker("model", "Adapter", [(model, model) for model in found["models"]], chosen["model"]),
        _picker("version", "Version", [(str(v["id"]), v["label"]) for v in found["versions"]], chosen["version"]),
        _picker("worker", "Worker", [(url, url) for url in found["workers"]], chosen["worker"]),
    ]
    series = timeseries.latency_series(time_range=time_range, **chosen)
    return render(request, "dashboards/latency.html", {
        **_page(request, "latency", time_range, pickers), "series": series, "filtered": any(chosen.values()),
        "completed": sum(bucket["completed"] for bucket in series["buckets"]),
        "rows": [bucket for bucket in series["buckets"] if bucket["requests"]]})


@staff_only
def errors(request: HttpRequest) -> HttpResponse:
    time_range = _range(request)
    tenant = _text(request, "tenant")
    tenants = timeseries.latency_filters(time_range=time_range)["tenants"]
    if tenant and tenant not in tenants:
        tenants = [*tenants, tenant]  # keep the choice visible even when it has no rows in this range
    series = timeseries.error_series(time_range=time_range, tenant=tenant)
    return render(request, "dashboards/errors.html", {
        **_page(request, "errors", time_range, [_picker("tenant", "Tenant", [(s, s) for s in tenants], tenant)]),
        "series": series, "tenant": tenant,
        "totals": sorted(((f"{s['status']} {s['code']}".strip(), sum(s["counts"])) for s in series["series"]),
                         key=lambda pair: (-pair[1], pair[0])),
        "by_tenant": [{**row, "codes": sorted(row["by_code"].items())} for row in series["by_tenant"]]})


@staff_only
def objectives(request: HttpRequest) -> HttpResponse:
    time_range = _range(request)
    return render(request, "dashboards/objectives.html", {
        **_page(request, "objectives", time_range), "summary": timeseries.slo_summary(time_range=time_range)})


@staff_only
def adapters(request: HttpRequest) -> HttpResponse:
    time_range = _range(request)
    return render(request, "dashboards/adapters.html", {
        **_page(request, "adapters", time_range),
        "top": selectors.top_adapters(start=time_range.start, end=time_range.end)})


@staff_only
def billing(request: HttpRequest) -> HttpResponse:
    year, month = _month(request)
    return render(request, "dashboards/billing.html", {
        "section": "billing", "totals": selectors.billing_totals(year=year, month=month)})


def _latency_filters(request: HttpRequest) -> dict:
    return {name: _text(request, name) for name in ("tenant", "model", "version", "worker")}


# -- JSON -------------------------------------------------------------------------------------
@staff_only
def fleet_json(request: HttpRequest) -> JsonResponse:
    return JsonResponse(selectors.fleet_overview())


@staff_only
def fleet_history_json(request: HttpRequest) -> JsonResponse:
    time_range, worker = _range(request), _worker(request)
    history = fleet_history(time_range=time_range, worker=worker.pk if worker else None)
    return JsonResponse({"range": time_range.as_json(), **history})


@staff_only
def tenants_json(request: HttpRequest) -> JsonResponse:
    time_range = _range(request)
    return JsonResponse(timeseries.usage_totals(time_range=time_range))


@staff_only
def latency_json(request: HttpRequest) -> JsonResponse:
    time_range = _range(request)
    return JsonResponse(timeseries.latency_series(time_range=time_range, **_latency_filters(request)))


@staff_only
def errors_json(request: HttpRequest) -> JsonResponse:
    time_range = _range(request)
    return JsonResponse(timeseries.error_series(time_range=time_range, tenant=_text(request, "tenant")))


@staff_only
def objectives_json(request: HttpRequest) -> JsonResponse:
    return JsonResponse(timeseries.slo_summary(time_range=_range(request)))


@staff_only
def adapters_json(request: HttpRequest) -> JsonResponse:
    time_range = _range(request)
    return JsonResponse({"range": time_range.as_json(),
                         **selectors.top_adapters(start=time_range.start, end=time_range.end)})


@staff_only
def billing_json(request: HttpRequest) -> JsonResponse:
    year, month = _month(request)
    return JsonResponse(selectors.billing_totals(year=year, month=month))

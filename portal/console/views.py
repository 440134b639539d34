"""The tenant portal's pages. Thin: resolve the tenant (access.tenant_member), validate the form,
call a service or selector, render. Other apps own every rule."""

from __future__ import annotations

from datetime import UTC, date, timedelta

from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.urls import reverse, reverse_lazy
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from portal.adapters import deployments, traffic
from portal.adapters import selectors as adapter_selectors
from portal.adapters import services as adapter_services
from portal.adapters.limits import limits_for, tenant_storage_used
from portal.adapters.models import AdapterVersion
from portal.console import selectors
from portal.console.access import LOGIN_URL, can_write, require_write, tenant_member
from portal.console.forms import (
    AdapterCreateForm,
    ApiKeyCreateForm,
    CanaryGuardForm,
    UploadForm,
    WeightsForm,
    add_service_error,
)
from portal.core.exceptions import InvalidInput
from portal.core.ranges import parse_range
from portal.fleet.selectors import base_model_name
from portal.keys.selectors import api_key_list
from portal.keys.services import api_key_create, api_key_revoke
from portal.rollouts import selectors as rollout_selectors
from portal.rollouts import services as rollout_services
from portal.tenants.plans import plan_for
from portal.usage.billing import money, statement_for
from portal.usage.selectors import latency_percentiles

PAGE_SIZE = 20
COMPARISON_WINDOWS = ("1h", "24h", "7d")  # the adapter page's per-version comparison
COMPARISON_CHARTS = (("requests", "Requests"), ("error_rate", "Error rate"), ("ttft_p95_ms", "TTFT p95 (ms)"),
                     ("itl_p95_ms", "Inter-token p95 (ms)"), ("tokens_per_request", "Tokens per request"))
USAGE_RANGES = (7, 30, 90)


class LoginView(auth_views.LoginView):
    template_name = "console/login.html"
    redirect_authenticated_user = True
    next_page = reverse_lazy("console:tenants")


class LogoutView(auth_views.LogoutView):
    next_page = reverse_lazy("console:login")


def _render(request: HttpRequest, template: str, context: dict, *, status: int = 200) -> HttpResponse:
    tenant = getattr(request, "tenant", None)
    base = {
        "tenant": tenant,
        "membership": getattr(request, "membership", None),
        "can_write": can_write(request.membership) if tenant is not None else False,
    }
    return render(request, template, {**base, **context}, status=status)


def _page(request: HttpRequest, items, size: int = PAGE_SIZE):
    return Paginator(items, size).get_page(request.GET.get("page"))


@require_GET
@login_required(login_url=LOGIN_URL)
def tenant_picker(request: HttpRequest) -> HttpResponse:
    return _render(request, "console/tenants.html", {})


@require_GET
@tenant_member
def overview(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    summary = selectors.month_overview(tenant=request.tenant, now=now)
    adapters = adapter_selectors.adapter_list(tenant=request.tenant)
    first_adapter = adapters.first()
    return _render(request, "console/overview.html", {
        "summary": summary,
        "spend": money(summary.spend),
        "spend_limit": None if summary.spend_limit is None else money(summary.spend_limit),
        "spend_used": money(summary.spend_used),
        "plan": plan_for(request.tenant.plan),
        "adapter_count": adapters.count(),
        "key_count": api_key_list(tenant=request.tenant, usable_only=True).count(),
        # For the getting-started snippet: a model id this tenant can call right now.
        "example_model": first_adapter.public_id if first_adapter else (base_model_name() or "BASE-MODEL"),
    })


# --- API keys ------------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
@tenant_member
def keys(request: HttpRequest) -> HttpResponse:
    form = ApiKeyCreateForm(request.POST or None)
    created = None
    status = 200
    if request.method == "POST":
        require_write(request)
        if form.is_valid():
            try:
                key, plaintext = api_key_create(
                    tenant=request.tenant, name=form.cleaned_data["name"], created_by=request.user,
                    expires_at=form.cleaned_data["expires_at"], allowed_models=form.cleaned_data["allowed_models"],
                )
            except InvalidInput as error:
                add_service_error(form, error)
            else:
                # The secret is in this response only: it is not stored and never shown again.
                created = {"key": key, "plaintext": plaintext}
                form = ApiKeyCreateForm()
        if not form.is_valid() and form.is_bound:
            status = 400
    response = _render(request, "console/keys.html", {
        "form": form, "created": created, "page": _page(request, api_key_list(tenant=request.tenant)),
        "now": timezone.now(),
    }, status=status)
    response["Cache-Control"] = "no-store"
    return response


@require_POST
@tenant_member
def key_revoke(request: HttpRequest, key_id: int) -> HttpResponse:
    require_write(request)
    key = api_key_list(tenant=request.tenant).filter(pk=key_id).first()
    if key is None:
        raise Http404("No such key.")
    api_key_revoke(api_key=key)
    messages.success(request, f"Revoked the key “{key.name}” ({key.prefix}…). Requests with it now get 401.")
    return redirect("console:keys", slug=request.tenant.slug)


# --- adapters ------------------------------------------------------------------------------------


@require_http_methods(["GET", "POST"])
@tenant_member
def adapters(request: HttpRequest) -> HttpResponse:
    form = AdapterCreateForm(request.POST or None)
    status = 200
    if request.method == "POST":
        require_write(request)
        if form.is_valid():
            try:
                adapter = adapter_services.adapter_create(
                    tenant=request.tenant, name=form.cleaned_data["name"],
                    description=form.cleaned_data["description"], actor=request.user,
                )
            except InvalidInput as error:
                add_service_error(form, error)
            else:
                messages.success(request, f"Created {adapter.public_id}. Upload its first version below.")
                return redirect("console:adapter", slug=request.tenant.slug, name=adapter.name)
        status = 400
    limits = limits_for(request.tenant.plan)
    return _render(request, "console/adapters.html", {
        "form": form, "page": _page(request, adapter_selectors.adapter_list(tenant=request.tenant)),
        "limits": limits, "storage_used": tenant_storage_used(tenant=request.tenant),
    }, status=status)


def _adapter_or_404(request: HttpRequest, name: str):
    adapter = adapter_selectors.adapter_get(tenant=request.tenant, name=name)
    if adapter is None:
        raise Http404("No such adapter.")
    return adapter


def _adapter_page(request: HttpRequest, adapter, *, upload_form=None, weights_form=None, guard_form=None,
                  status=200) -> HttpResponse:
    deployment = deployments.deployment_get(adapter=adapter)
    versions = adapter_selectors.adapter_version_list(adapter=adapter)
    ready = [v for v in versions if v.status == AdapterVersion.Status.READY]
    served = {v.number for v in traffic.deployed_versions(adapter=adapter)}
    window = request.GET.get("window") if request.GET.get("window") in COMPARISON_WINDOWS else "24h"
    guard = rollout_selectors.canary_guard_get(deployment=deployment)
    return _render(request, "console/adapter_detail.html", {
        "comparison": rollout_selectors.version_comparison(
            adapter=adapter, time_range=parse_range({"range": window}, now=timezone.now())),
        "comparison_windows": COMPARISON_WINDOWS, "comparison_charts": COMPARISON_CHARTS, "window": window,
        "rollback_banner": rollout_selectors.rollback_banner(adapter=adapter),
        "guard": guard, "guard_form": guard_form or CanaryGuardForm(guard=guard),
        "adapter": adapter,
        "deployment": deployment,
        "page": _page(request, versions),
        "ready_versions": ready,
        "served": served,
        "upload_form": upload_form or UploadForm(),
        "weights_form": weights_form or WeightsForm(versions=ready, current=deployment.weights),
        "always_warm_allowed": plan_for(request.tenant.plan).always_warm_adapters,
        "pending": [v.number for v in versions if v.status in (AdapterVersion.Status.UPLOADED,
                                                              AdapterVersion.Status.VALIDATING)],
        "api_upload_url": reverse("api:adapter-version-list", kwargs={
            "tenant_slug": request.tenant.slug, "adapter_name": adapter.name}),
    }, status=status)


@require_GET
@tenant_member
def adapter_detail(request: HttpRequest, name: str) -> HttpResponse:
    return _adapter_page(request, _adapter_or_404(request, name))


@require_POST
@tenant_member
def adapter_upload(request: HttpRequest, name: str) -> HttpResponse:
    """The upload form without JavaScript (with it, the page posts to the REST API instead)."""
    adapter = _adapter_or_404(request, name)
    require_write(request)
    form = UploadForm(request.POST, request.FILES)
    if form.is_valid():
        try:
            version = adapter_services.adapter_version_upload(
                adapter=adapter, files=form.cleaned_data["files"], actor=request.user)
        except InvalidInput as error:
            add_service_error(form, error)
        else:
            messages.success(request, f"Uploaded v{version.number}; it is being validated.")
            return redirect("console:adapter", slug=request.tenant.slug, name=adapter.name)
    return _adapter_page(request, adapter, upload_form=form, status=400)


@require_POST
@tenant_member
def adapter_deployment(request: HttpRequest, name: str) -> HttpResponse:
    """Weights editor and rollback (a rollback posts weight_<n>=1 for the version it restores)."""
    adapter = _adapter_or_404(request, name)
    require_write(request)
    ready = list(adapter_selectors.adapter_version_list(adapter=adapter).filter(status=AdapterVersion.Status.READY))
    form = WeightsForm(request.POST, versions=ready)
    if form.is_valid():
        try:
            deployments.deployment_set_weights(adapter=adapter, weights=form.weights(), actor=request.user)
        except InvalidInput as error:
            add_service_error(form, error)
        else:
            weights = form.weights()
            shown = ", ".join(f"v{n}: {w}" for n, w in weights.items()) or "newest ready version"
            messages.success(request, f"Deployment of {adapter.public_id} set ({shown}).")
            return redirect("console:adapter", slug=request.tenant.slug, name=adapter.name)
    return _adapter_page(request, adapter, weights_form=form, status=400)


@require_POST
@tenant_member
def adapter_always_warm(request: HttpRequest, name: str) -> HttpResponse:
    adapter = _adapter_or_404(request, name)
    require_write(request)
    enabled = request.POST.get("enabled") == "1"
    try:
        deployments.deployment_set_always_warm(adapter=adapter, enabled=enabled, actor=request.user)
    except InvalidInput as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"{adapter.public_id} is {'now' if enabled else 'no longer'} kept warm.")
    return redirect("console:adapter", slug=request.tenant.slug, name=adapter.name)


@require_POST
@tenant_member
def adapter_canary_guard(request: HttpRequest, name: str) -> HttpResponse:
    """The canary guard's thresholds (the automatic rollback of a failing canary)."""
    adapter = _adapter_or_404(request, name)
    require_write(request)
    deployment = deployments.deployment_get(adapter=adapter)
    form = CanaryGuardForm(request.POST, guard=rollout_selectors.canary_guard_get(deployment=deployment))
    if form.is_valid():
        try:
            rollout_services.canary_guard_update(deployment=deployment, actor=request.user, **form.cleaned_data)
        except InvalidInput as error:
            add_service_error(form, error)
        else:
            messages.success(request, f"Canary guard of {adapter.public_id} saved.")
            return redirect("console:adapter", slug=request.tenant.slug, name=adapter.name)
    return _adapter_page(request, adapter, guard_form=form, status=400)


@require_POST
@tenant_member
def adapter_canary_dismiss(request: HttpRequest, name: str) -> HttpResponse:
    adapter = _adapter_or_404(request, name)
    require_write(request)
    rollout_services.canary_guard_dismiss(deployment=deployments.deployment_get(adapter=adapter), actor=request.user)
    return redirect("console:adapter", slug=request.tenant.slug, name=adapter.name)


# --- usage and billing ---------------------------------------------------------------------------


def _usage_range(request: HttpRequest) -> tuple[int, date, date]:
    try:
        days = int(request.GET.get("days", 30))
    except ValueError:
        days = 30
    days = days if days in USAGE_RANGES else 30
    end = timezone.now().astimezone(UTC).date()
    return days, end - timedelta(days=days - 1), end


@require_GET
@tenant_member
def usage(request: HttpRequest) -> HttpResponse:
    days, start, end = _usage_range(request)
    now = timezone.now()
    return _render(request, "console/usage.html", {
        "days": days, "ranges": USAGE_RANGES, "start": start, "end": end,
        "by_model": selectors.usage_models(tenant=request.tenant, start=start, end=end, today=end),
        "latency": latency_percentiles(tenant=request.tenant, start=start, end=end),
        "year": now.year, "month": f"{now.month:02d}",
    })


@require_GET
@tenant_member
def usage_daily_json(request: HttpRequest) -> JsonResponse:
    days, start, end = _usage_range(request)
    rows = selectors.usage_days(tenant=request.tenant, start=start, end=end, today=end)
    return JsonResponse({
        "start": start.isoformat(), "end": end.isoformat(),
        "labels": [row["date"].isoformat() for row in rows],
        "requests": [row["requests"] for row in rows],
        "errors": [row["errors"] for row in rows],
        "prompt_tokens": [row["prompt_tokens"] for row in rows],
        "completion_tokens": [row["completion_tokens"] for row in rows],
    })


@require_GET
@tenant_member
def usage_models_json(request: HttpRequest) -> JsonResponse:
    days, start, end = _usage_range(request)
    rows = selectors.usage_models(tenant=request.tenant, start=start, end=end, today=end)
    return JsonResponse({
        "start": start.isoformat(), "end": end.isoformat(),
        "labels": [row["model"] for row in rows],
        "requests": [row["requests"] for row in rows],
        "total_tokens": [row["total_tokens"] for row in rows],
    })


@require_GET
@tenant_member
def billing(request: HttpRequest) -> HttpResponse:
    now = timezone.now()
    months = selectors.statement_months(tenant=request.tenant, now=now)
    chosen = request.GET.get("month") or f"{months[0][0]:04d}-{months[0][1]:02d}"
    try:
        year, month = (int(part) for part in chosen.split("-"))
        statement = statement_for(tenant=request.tenant, year=year, month=month)
    except (ValueError, InvalidInput):
        raise Http404("No such month.") from None
    return _render(request, "console/billing.html", {
        "months": [f"{y:04d}-{m:02d}" for y, m in months],
        "statement": statement,
        "lines": [{"line": line, "cost": money(line.cost), "prompt_cost": money(line.prompt_cost),
                   "completion_cost": money(line.completion_cost)} for line in statement.lines],
        "total": money(statement.total_cost),
        "csv_url": reverse("usage:statement-csv", kwargs={
            "tenant_slug": request.tenant.slug, "year": f"{statement.year:04d}", "month": f"{statement.month:02d}"}),
    })

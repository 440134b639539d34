"""The evaluation pages of the tenant console (thin: access, form, service or selector, render).

    /t/<slug>/adapters/<name>/evaluation/             the set (upload), the gate, each version's latest run
    /t/<slug>/adapters/<name>/versions/<n>/           a version: its runs, pass rates side by side, the
                                                      cases whose verdict changed with both outputs
    /t/<slug>/adapters/<name>/versions/<n>/evaluate/  POST: run again
"""

from __future__ import annotations

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from portal.adapters import deployments
from portal.adapters import selectors as adapter_selectors
from portal.console.access import can_write, require_write, tenant_member
from portal.console.forms import add_service_error
from portal.core.exceptions import InvalidInput
from portal.evals import selectors, services
from portal.evals.forms import EvaluationSetForm, GateForm
from portal.evals.validation import MAX_FILE_BYTES


def _adapter(request: HttpRequest, name: str):
    adapter = adapter_selectors.adapter_get(tenant=request.tenant, name=name)
    if adapter is None:
        raise Http404("No such adapter.")
    return adapter


def _render(request: HttpRequest, template: str, context: dict, *, status: int = 200) -> HttpResponse:
    base = {"tenant": request.tenant, "membership": request.membership, "can_write": can_write(request.membership)}
    return render(request, template, {**base, **context}, status=status)


def _adapter_page(request, adapter, *, set_form=None, gate_form=None, status=200) -> HttpResponse:
    deployment = deployments.deployment_get(adapter=adapter)
    runs = selectors.evaluation_runs_by_version(adapter=adapter)
    versions = list(adapter_selectors.adapter_version_list(adapter=adapter))
    return _render(request, "evals/adapter.html", {
        "adapter": adapter,
        "deployment": deployment,
        "evaluation_set": selectors.evaluation_set_current(adapter=adapter),
        "rows": [(v, runs.get(v.number)) for v in versions],
        "set_form": set_form or EvaluationSetForm(),
        "gate_form": gate_form or GateForm(initial={
            "require_evaluation": deployment.require_evaluation,
            "evaluation_min_pass_rate": None if deployment.evaluation_min_pass_rate is None
            else round(deployment.evaluation_min_pass_rate * 100)}),
    }, status=status)


@require_http_methods(["GET", "POST"])
@tenant_member
def adapter_evaluation(request: HttpRequest, name: str) -> HttpResponse:
    adapter = _adapter(request, name)
    if request.method == "GET":
        return _adapter_page(request, adapter)
    require_write(request)
    form = EvaluationSetForm(request.POST, request.FILES)
    if form.is_valid():
        upload = form.cleaned_data["file"]
        try:
            if upload.size > MAX_FILE_BYTES:
                raise InvalidInput("file", f"the file is {upload.size} bytes; the limit is {MAX_FILE_BYTES} bytes")
            evaluation_set = services.evaluation_set_upload(adapter=adapter, data=upload.read(),
                                                            filename=upload.name, actor=request.user)
        except InvalidInput as error:
            add_service_error(form, error)
        else:
            messages.success(request, f"Evaluation set uploaded: {evaluation_set.case_count} cases "
                                      f"({evaluation_set.checked_count} with a check). It runs when a version becomes ready.")
            return redirect("evals:adapter", slug=request.tenant.slug, name=adapter.name)
    return _adapter_page(request, adapter, set_form=form, status=400)


@require_POST
@tenant_member
def adapter_gate(request: HttpRequest, name: str) -> HttpResponse:
    adapter = _adapter(request, name)
    require_write(request)
    form = GateForm(request.POST)
    if form.is_valid():
        try:
            deployments.deployment_set_evaluation_gate(
                adapter=adapter, require=form.cleaned_data["require_evaluation"], min_pass_rate=form.min_pass_rate(),
                actor=request.user)
        except InvalidInput as error:
            add_service_error(form, error)
        else:
            messages.success(request, "Evaluation gate saved.")
            return redirect("evals:adapter", slug=request.tenant.slug, name=adapter.name)
    return _adapter_page(request, adapter, gate_form=form, status=400)


def _version(request: HttpRequest, adapter, number: int):
    version = adapter_selectors.adapter_version_get(adapter=adapter, number=number)
    if version is None:
        raise Http404("No such version.")
    return version


@require_GET
@tenant_member
def version_detail(request: HttpRequest, name: str, number: int) -> HttpResponse:
    adapter = _adapter(request, name)
    version = _version(request, adapter, number)
    runs = list(selectors.evaluation_run_list(version=version)[:20])
    shown = runs[0] if runs else None
    if "run" in request.GET and request.GET["run"].isdigit():
        shown = selectors.evaluation_run_get(version=version, run_id=int(request.GET["run"])) or shown
    rows = selectors.evaluation_run_rows(run=shown) if shown is not None else []
    deployment = deployments.deployment_get(adapter=adapter)
    return _render(request, "evals/version.html", {
        "adapter": adapter, "version": version, "runs": runs, "run": shown, "rows": rows,
        "changed": [row for row in rows if row.changed],
        "evaluation_set": selectors.evaluation_set_current(adapter=adapter),
        "deployment": deployment,
        "gate_refusal": selectors.evaluation_gate_refusal(version=version, deployment=deployment),
    })


@require_POST
@tenant_member
def version_evaluate(request: HttpRequest, name: str, number: int) -> HttpResponse:
    adapter = _adapter(request, name)
    version = _version(request, adapter, number)
    require_write(request)
    try:
        run = services.evaluation_run_again(version=version, actor=request.user)
    except InvalidInput as error:
        messages.error(request, error.message)
    else:
        messages.success(request, f"Evaluation run {run.pk} of {version.public_id} queued.")
    return redirect("evals:version", slug=request.tenant.slug, name=adapter.name, number=version.number)

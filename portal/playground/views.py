from asgiref.sync import async_to_sync
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from portal.playground.services import MAX_COLUMNS, playground_models
from portal.tenants.models import Membership
from portal.tenants.selectors import membership_get, tenant_get_by_slug


@login_required
@require_GET
def playground(request: HttpRequest, slug: str) -> HttpResponse:
    """The chat page; the conversation itself runs over the websocket (consumers.py)."""
    tenant = tenant_get_by_slug(slug=slug)
    membership = membership_get(tenant=tenant, user=request.user) if tenant is not None else None
    if membership is None:
        raise Http404("No such tenant.")
    models = async_to_sync(playground_models)(tenant=tenant)
    return render(request, "playground/playground.html", {
        "tenant": tenant,
        "membership": membership,
        "models": models,
        "can_chat": membership.role != Membership.Role.VIEWER and tenant.is_active,
        "ws_path": f"/ws/t/{tenant.slug}/playground/",
        # the "compare with" selects: the models after the first, side by side
        "compare_slots": range(2, MAX_COLUMNS + 1),
    })

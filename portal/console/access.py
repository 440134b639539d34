"""Who may see a tenant's pages: its members. Anyone else gets the same 404 whether or not the
tenant exists; viewers read, members/admins/owners also write."""

from __future__ import annotations

from functools import wraps

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest
from django.shortcuts import render
from django.urls import reverse_lazy

from portal.tenants.models import Membership
from portal.tenants.selectors import membership_get, tenant_get_by_slug

WRITE_ROLES = (Membership.Role.OWNER, Membership.Role.ADMIN, Membership.Role.MEMBER)
LOGIN_URL = reverse_lazy("console:login")


def can_write(membership: Membership) -> bool:
    return membership.role in WRITE_ROLES


class ReadOnlyRole(PermissionDenied):
    """A viewer tried to change something: tenant_member renders it as a 403 page with the message."""


def require_write(request: HttpRequest) -> None:
    if not request.tenant.is_active:
        raise ReadOnlyRole(f"The tenant {request.tenant.slug} is suspended: nothing can be changed until it is reactivated.")
    if not can_write(request.membership):
        raise ReadOnlyRole(
            f"Your role in {request.tenant.slug} is {request.membership.role}, which is read-only; "
            "ask an owner or admin to make this change or to give you the member role."
        )


def tenant_member(view):
    """Signed in, and a member of the tenant named by the URL's `slug` (request.tenant,
    request.membership); otherwise 404 without saying whether the tenant exists."""

    @login_required(login_url=LOGIN_URL)
    @wraps(view)
    def wrapper(request: HttpRequest, slug: str, *args, **kwargs):
        tenant = tenant_get_by_slug(slug=slug)
        membership = membership_get(tenant=tenant, user=request.user) if tenant is not None else None
        if membership is None:
            # The same page whether the tenant exists or not.
            return render(request, "console/not_found.html", {}, status=404)
        request.tenant = tenant
        request.membership = membership
        try:
            return view(request, *args, **kwargs)
        except Http404:
            context = {"tenant": tenant, "membership": membership}
            return render(request, "console/not_found.html", context, status=404)
        except ReadOnlyRole as error:
            context = {"tenant": tenant, "membership": membership, "message": str(error)}
            return render(request, "console/forbidden.html", context, status=403)

    return wrapper

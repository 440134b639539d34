"""Who may use a tenant's part of the REST API.

    API key        its own tenant: read and write (a suspended tenant: 403)
    session user   a member: viewers read, members/admins/owners also write; staff read any tenant
    anyone else    404 for another tenant, whether it exists or not; 401 when not signed in
"""

from __future__ import annotations

from rest_framework.exceptions import NotAuthenticated, NotFound, PermissionDenied
from rest_framework.permissions import SAFE_METHODS, BasePermission

from portal.keys.models import ApiKey
from portal.tenants.models import Membership
from portal.tenants.selectors import membership_get, tenant_get_by_slug

WRITE_ROLES = (Membership.Role.OWNER, Membership.Role.ADMIN, Membership.Role.MEMBER)
NOT_FOUND = "No such tenant."


class TenantAccess(BasePermission):
    """Resolves view.kwargs["tenant_slug"] into view.tenant, or refuses the request."""

    def has_permission(self, request, view) -> bool:
        api_key = request.auth if isinstance(request.auth, ApiKey) else None
        user = request.user
        if api_key is None and not (user and user.is_authenticated):
            raise NotAuthenticated("Sign in, or send an API key as 'Authorization: Bearer sk-...'.")
        tenant = tenant_get_by_slug(slug=view.kwargs.get("tenant_slug", ""))
        if tenant is None:
            raise NotFound(NOT_FOUND)
        read_only = request.method in SAFE_METHODS
        if api_key is not None:
            if api_key.tenant_id != tenant.pk:
                raise NotFound(NOT_FOUND)
            if not tenant.is_active:
                raise PermissionDenied(f"The tenant {tenant.slug} is suspended.")
        else:
            membership = membership_get(tenant=tenant, user=user)
            if membership is None:
                if not (user.is_staff and read_only):
                    raise NotFound(NOT_FOUND)
            elif not read_only and membership.role not in WRITE_ROLES:
                raise PermissionDenied(
                    f"Your role in {tenant.slug} is {membership.role}, which is read-only; "
                    "a member, admin or owner can make changes."
                )
            if not read_only and not tenant.is_active:
                raise PermissionDenied(f"The tenant {tenant.slug} is suspended.")
        view.tenant = tenant
        return True

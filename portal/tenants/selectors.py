"""Reads on tenants and memberships."""

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import QuerySet

from portal.tenants.models import Membership, Tenant


def tenant_get_by_slug(*, slug: str) -> Tenant | None:
    return Tenant.objects.filter(slug=slug).first()


def membership_get(*, tenant: Tenant, user: AbstractBaseUser) -> Membership | None:
    return Membership.objects.filter(tenant=tenant, user=user).first()


def membership_list_for_user(*, user: AbstractBaseUser) -> QuerySet[Membership]:
    return Membership.objects.filter(user=user).select_related("tenant").order_by("tenant__slug")

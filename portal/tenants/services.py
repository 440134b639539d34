"""Writes on tenants and memberships."""

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction

from portal.core.exceptions import InvalidInput, full_clean_or_raise
from portal.tenants.models import Membership, Tenant


@transaction.atomic
def tenant_create(*, slug: str, name: str, plan: str = Tenant.Plan.FREE) -> Tenant:
    tenant = Tenant(slug=slug, name=name.strip(), plan=plan)
    full_clean_or_raise(tenant)
    tenant.save()
    return tenant


def tenant_suspend(*, tenant: Tenant) -> Tenant:
    return _tenant_set_status(tenant=tenant, status=Tenant.Status.SUSPENDED)


def tenant_activate(*, tenant: Tenant) -> Tenant:
    return _tenant_set_status(tenant=tenant, status=Tenant.Status.ACTIVE)


def _tenant_set_status(*, tenant: Tenant, status: str) -> Tenant:
    tenant.status = status
    tenant.save(update_fields=["status"])
    return tenant


@transaction.atomic
def membership_create(
    *, tenant: Tenant, user: AbstractBaseUser, role: str = Membership.Role.MEMBER
) -> Membership:
    if Membership.objects.filter(tenant=tenant, user=user).exists():
        raise InvalidInput("user", f"{user} is already a member of {tenant}")
    membership = Membership(tenant=tenant, user=user, role=role)
    full_clean_or_raise(membership)
    membership.save()
    return membership


def membership_set_role(*, membership: Membership, role: str) -> Membership:
    membership.role = role
    full_clean_or_raise(membership)
    membership.save(update_fields=["role"])
    return membership

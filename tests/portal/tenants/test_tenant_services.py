import pytest
from django.db import IntegrityError, transaction

from portal.core.exceptions import InvalidInput
from portal.tenants.models import Membership, Tenant
from portal.tenants.selectors import membership_get, membership_list_for_user, tenant_get_by_slug
from portal.tenants.services import (
    membership_create,
    membership_set_role,
    tenant_activate,
    tenant_create,
    tenant_suspend,
)

pytestmark = pytest.mark.django_db


def test_tenant_create_stores_an_active_free_tenant():
    tenant = tenant_create(slug="acme-labs", name="  Acme Labs ")

    stored = tenant_get_by_slug(slug="acme-labs")
    assert stored == tenant
    assert (stored.name, stored.plan, stored.status) == ("Acme Labs", "free", "active")
    assert stored.is_active
    assert stored.created_at is not None


@pytest.mark.parametrize(
    "slug", ["Acme", "acme/bots", "acme@v1", "-acme", "acme-", "a_b", "", "x" * 51]
)
def test_tenant_create_rejects_slugs_unfit_for_model_ids(slug):
    with pytest.raises(InvalidInput) as caught:
        tenant_create(slug=slug, name="Acme")

    assert caught.value.field == "slug"
    assert not Tenant.objects.exists()


def test_tenant_create_rejects_a_taken_slug():
    tenant_create(slug="acme", name="Acme")

    with pytest.raises(InvalidInput, match="already exists") as caught:
        tenant_create(slug="acme", name="Another Acme")
    assert caught.value.field == "slug"


def test_tenant_create_rejects_an_unknown_plan_and_an_empty_name():
    with pytest.raises(InvalidInput) as caught:
        tenant_create(slug="acme", name="Acme", plan="platinum")
    assert caught.value.field == "plan"

    with pytest.raises(InvalidInput) as caught:
        tenant_create(slug="acme", name="   ")
    assert caught.value.field == "name"


def test_tenant_suspend_and_activate(tenant):
    tenant_suspend(tenant=tenant)
    tenant.refresh_from_db()
    assert tenant.status == Tenant.Status.SUSPENDED and not tenant.is_active

    tenant_activate(tenant=tenant)
    tenant.refresh_from_db()
    assert tenant.is_active


def test_tenant_get_by_slug_returns_none_for_unknown():
    assert tenant_get_by_slug(slug="nobody") is None


def test_membership_create_and_read_back(tenant, user):
    membership = membership_create(tenant=tenant, user=user, role=Membership.Role.OWNER)

    assert membership_get(tenant=tenant, user=user) == membership
    assert list(membership_list_for_user(user=user)) == [membership]


def test_membership_default_role_is_member(tenant, user):
    assert membership_create(tenant=tenant, user=user).role == Membership.Role.MEMBER


def test_a_user_joins_a_tenant_once(tenant, user):
    membership_create(tenant=tenant, user=user)

    with pytest.raises(InvalidInput, match="already a member") as caught:
        membership_create(tenant=tenant, user=user, role=Membership.Role.ADMIN)
    assert caught.value.field == "user"


def test_the_database_enforces_one_membership_per_user_and_tenant(tenant, user):
    Membership.objects.create(tenant=tenant, user=user)

    with pytest.raises(IntegrityError), transaction.atomic():
        Membership.objects.create(tenant=tenant, user=user, role=Membership.Role.VIEWER)


def test_membership_roles_are_validated(tenant, user):
    with pytest.raises(InvalidInput) as caught:
        membership_create(tenant=tenant, user=user, role="superuser")
    assert caught.value.field == "role"

    membership = membership_create(tenant=tenant, user=user)
    membership_set_role(membership=membership, role=Membership.Role.VIEWER)
    membership.refresh_from_db()
    assert membership.role == "viewer"


def test_membership_list_for_user_is_ordered_by_tenant_and_excludes_others(user, django_user_model):
    zeta = tenant_create(slug="zeta", name="Zeta")
    alpha = tenant_create(slug="alpha", name="Alpha")
    membership_create(tenant=zeta, user=user)
    membership_create(tenant=alpha, user=user)
    someone_else = django_user_model.objects.create_user(username="bob")
    membership_create(tenant=alpha, user=someone_else)

    assert [m.tenant.slug for m in membership_list_for_user(user=user)] == ["alpha", "zeta"]

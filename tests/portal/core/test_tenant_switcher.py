"""The header's tenant switcher (context_processors.memberships) is on every signed-in page,
not only the console's: the playground and the dashboards too."""

import pytest

from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def two_tenant_staff(client, django_user_model, settings):
    settings.INFERENCE_URLS = []  # the playground page lists no model: no worker needed
    user = django_user_model.objects.create_user(username="ada", password="x", is_staff=True)
    for slug in ("acme", "globex"):
        membership_create(tenant=tenant_create(slug=slug, name=slug.title()), user=user, role=Membership.Role.MEMBER)
    client.force_login(user)
    return client


@pytest.mark.parametrize("path", ["/", "/t/", "/t/acme/", "/t/acme/playground/", "/dashboards/", "/t/nope/"])
def test_a_member_of_two_tenants_can_switch_from_any_page(two_tenant_staff, path):
    html = two_tenant_staff.get(path).content.decode()
    assert 'id="tenant-switch"' in html and ">Acme</option>" in html and ">Globex</option>" in html


def test_the_current_tenant_is_selected(two_tenant_staff):
    html = two_tenant_staff.get("/t/globex/playground/").content.decode()
    assert 'value="/t/globex/" selected>Globex</option>' in html


def test_anonymous_pages_have_no_switcher(client):
    assert 'id="tenant-switch"' not in client.get("/").content.decode()

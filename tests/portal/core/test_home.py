import pytest

from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create, tenant_suspend

pytestmark = pytest.mark.django_db


def test_front_page_describes_the_portal_and_links_admin_and_health(client):
    response = client.get("/")

    assert response.status_code == 200
    assert [template.name for template in response.templates][:2] == ["core/home.html", "base.html"]
    html = response.content.decode()
    assert "LoRA adapters" in html
    assert 'href="/admin/"' in html
    assert 'href="/healthz"' in html
    assert "Your tenants" not in html  # anonymous visitors see no tenant list
    assert 'href="/login/"' in html and "http://testserver/v1" in html  # where to sign in, where to call
    assert "/dashboards/" not in html  # staff only


def test_front_page_stylesheet_is_served(client):
    html = client.get("/").content.decode()
    assert 'href="/static/css/portal.css"' in html

    response = client.get("/static/css/portal.css")

    assert response.status_code == 200
    assert b"".join(response.streaming_content).startswith(b":root")


def test_signed_in_user_sees_their_tenants_and_roles(client, user, tenant):
    membership_create(tenant=tenant, user=user, role=Membership.Role.ADMIN)
    other = tenant_create(slug="globex", name="Globex")
    tenant_suspend(tenant=other)
    membership_create(tenant=other, user=user, role=Membership.Role.VIEWER)
    tenant_create(slug="initech", name="Initech")  # not a member
    client.force_login(user)

    html = client.get("/").content.decode()

    assert "Acme Corp" in html and "&middot; Admin" in html
    assert "Globex" in html and "&middot; Viewer" in html and "suspended" in html
    assert "Initech" not in html
    assert 'href="/t/acme/"' in html and 'href="/t/"' in html  # straight into the portal


def test_signed_in_user_without_tenants_is_told_so(client, user):
    client.force_login(user)

    assert "not a member of any tenant" in client.get("/").content.decode()


def test_front_page_rejects_post(client):
    assert client.post("/").status_code == 405


def test_staff_see_the_dashboards_card(client, user):
    user.is_staff = True
    user.save()
    client.force_login(user)
    assert 'href="/dashboards/"' in client.get("/").content.decode()

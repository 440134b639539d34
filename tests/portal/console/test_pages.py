"""Every console page renders for a member, is a 404 for anyone else (exists or not), and a
viewer reads but cannot change anything."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from portal.adapters.services import adapter_create
from portal.keys.services import api_key_create
from portal.usage.services import usage_record_create

pytestmark = pytest.mark.django_db

PAGES = ["overview", "keys", "adapters", "usage", "billing"]


@pytest.mark.parametrize("page", PAGES)
def test_each_page_renders_for_a_member(mia, tenant, page):
    response = mia.get(reverse(f"console:{page}", args=[tenant.slug]))
    assert response.status_code == 200
    assert b"Acme Corp" in response.content


def test_adapter_page_renders(mia, tenant, member):
    adapter_create(tenant=tenant, name="bot", actor=member)
    response = mia.get(reverse("console:adapter", args=[tenant.slug, "bot"]))
    assert response.status_code == 200
    assert b"acme/bot" in response.content
    assert b"No versions yet" in response.content


@pytest.mark.parametrize("page", PAGES)
def test_other_tenants_pages_are_404_like_missing_ones(mia, other_tenant, page):
    theirs = mia.get(reverse(f"console:{page}", args=[other_tenant.slug]))
    missing = mia.get(reverse(f"console:{page}", args=["no-such-tenant"]))
    assert theirs.status_code == missing.status_code == 404
    assert b"Globex" not in theirs.content


def test_other_tenants_adapter_and_json_are_404(mia, other_tenant, django_user_model):
    adapter_create(tenant=other_tenant, name="secret-bot", actor=None)
    assert mia.get(reverse("console:adapter", args=[other_tenant.slug, "secret-bot"])).status_code == 404
    assert mia.get(reverse("console:usage-daily-json", args=[other_tenant.slug])).status_code == 404
    response = mia.post(reverse("console:keys", args=[other_tenant.slug]), {"name": "x"})
    assert response.status_code == 404


def test_anonymous_is_sent_to_login(tenant):
    response = Client().get(reverse("console:overview", args=[tenant.slug]))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("console:login"))


def test_login_logout_and_tenant_picker(member, tenant, other_tenant):
    from portal.tenants.services import membership_create

    membership_create(tenant=other_tenant, user=member, role="viewer")
    client = Client(enforce_csrf_checks=True)
    page = client.get(reverse("console:login"))
    assert page.status_code == 200
    token = page.cookies["csrftoken"].value
    bad = client.post(reverse("console:login"), {"username": "mia", "password": "wrong",
                                                 "csrfmiddlewaretoken": token})
    assert bad.status_code == 200 and b"correct username and password" in bad.content
    ok = client.post(reverse("console:login"), {"username": "mia", "password": "pw-mia", "csrfmiddlewaretoken": token})
    assert ok.status_code == 302 and ok["Location"] == reverse("console:tenants")
    picker = client.get(reverse("console:tenants"))
    assert b"Acme Corp" in picker.content and b"Globex" in picker.content
    overview = client.get(reverse("console:overview", args=["globex"]))
    assert b'id="tenant-switch"' in overview.content  # a member of two tenants can switch
    token = client.cookies["csrftoken"].value
    out = client.post(reverse("console:logout"), {"csrfmiddlewaretoken": token})
    assert out.status_code == 302
    assert client.get(reverse("console:tenants")).status_code == 302


def test_overview_counts_the_month(mia, tenant):
    usage_record_create(request_id="r1", tenant=tenant, model="acme/bot", prompt_tokens=10, completion_tokens=5)
    usage_record_create(request_id="r2", tenant=tenant, model="acme/bot", status_code=500, error="worker died")
    response = mia.get(reverse("console:overview", args=[tenant.slug]))
    assert response.context["summary"].requests == 2
    assert response.context["summary"].errors == 1
    assert response.context["summary"].total_tokens == 15
    assert response.context["summary"].budget_tokens == 2_000_000  # the free plan's
    assert 'id="getting-started"' not in response.content.decode()  # it has been used
    assert "15 of 2,000,000 tokens used" in response.content.decode()  # thousands grouped


def test_a_new_tenant_is_shown_how_to_start(mia, tenant, member):
    html = mia.get(reverse("console:overview", args=[tenant.slug])).content.decode()
    assert 'id="getting-started"' in html
    assert "Create an API key" in html and "Create an adapter" in html
    assert 'base_url="http://testserver/v1"' in html and 'href="/t/acme/playground/"' in html

    api_key_create(tenant=tenant, name="ci", created_by=member)
    adapter_create(tenant=tenant, name="bot", actor=member)
    html = mia.get(reverse("console:overview", args=[tenant.slug])).content.decode()
    assert "You have an API key." in html and 'model="acme/bot"' in html


def test_user_strings_are_escaped(mia, tenant, member):
    api_key_create(tenant=tenant, name="<script>alert(1)</script>", created_by=member)
    adapter_create(tenant=tenant, name="bot", description="<img src=x onerror=alert(1)>", actor=member)
    usage_record_create(request_id="r1", tenant=tenant, model="<b>bold</b>")
    for url in (reverse("console:keys", args=[tenant.slug]), reverse("console:adapter", args=[tenant.slug, "bot"]),
                reverse("console:usage", args=[tenant.slug]), reverse("console:billing", args=[tenant.slug])):
        body = mia.get(url).content
        assert b"<script>alert" not in body and b"<img src=x" not in body and b"<b>bold" not in body


def test_billing_shows_a_statement_and_its_csv(mia, tenant):
    usage_record_create(request_id="r1", tenant=tenant, model="acme/bot", prompt_tokens=1_000_000,
                        completion_tokens=1_000_000)
    response = mia.get(reverse("console:billing", args=[tenant.slug]))
    assert response.context["total"] == "0.40"  # free plan: 0.10 + 0.30 per 1M
    csv_url = response.context["csv_url"]
    assert csv_url.endswith(".csv") and csv_url.encode() in response.content
    assert mia.get(csv_url).status_code == 200
    assert mia.get(reverse("console:billing", args=[tenant.slug]) + "?month=2026-13").status_code == 404


def test_adapter_list_paginates(mia, tenant, member, settings):
    from portal.adapters import limits

    limits.PLAN_LIMITS["free"] = limits.AdapterLimits(max_adapters=None, max_storage_bytes=None)
    try:
        for i in range(25):
            adapter_create(tenant=tenant, name=f"a{i:02d}", actor=member)
    finally:
        limits.PLAN_LIMITS["free"] = limits.AdapterLimits(max_adapters=5, max_storage_bytes=2 * limits.GIB)
    first = mia.get(reverse("console:adapters", args=[tenant.slug]))
    assert b"Page 1 of 2" in first.content and b"a19" in first.content and b"a20" not in first.content
    second = mia.get(reverse("console:adapters", args=[tenant.slug]) + "?page=2")
    assert b"a24" in second.content

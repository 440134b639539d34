"""Staff cannot mark an adapter version ready (or anything else) by hand in the Django admin:
a version's status changes only through the services (upload -> validate -> stage, retire)."""

import pytest

from portal.adapters.models import Adapter, AdapterVersion

pytestmark = pytest.mark.django_db


@pytest.fixture
def rejected(tenant) -> AdapterVersion:
    adapter = Adapter.objects.create(tenant=tenant, name="bot")
    return AdapterVersion.objects.create(adapter=adapter, number=1, status=AdapterVersion.Status.REJECTED,
                                         rejection_reasons=["lora_A: rank 64 is over the limit of 16"])


def test_the_version_change_form_shows_the_status_without_a_field_to_edit_it(admin_client, rejected):
    page = admin_client.get(f"/admin/adapters/adapterversion/{rejected.pk}/change/")

    assert page.status_code == 200
    html = page.content.decode()
    assert "Rejected" in html
    assert 'name="status"' not in html
    assert 'name="_save"' not in html


def test_a_post_to_the_version_change_form_leaves_the_status_unchanged(admin_client, rejected):
    response = admin_client.post(f"/admin/adapters/adapterversion/{rejected.pk}/change/",
                                 {"adapter": rejected.adapter_id, "number": 1, "status": "ready"})

    assert response.status_code == 403
    rejected.refresh_from_db()
    assert rejected.status == AdapterVersion.Status.REJECTED


def test_a_version_cannot_be_added_in_the_admin_where_it_would_start_out_ready(admin_client, rejected):
    assert admin_client.get("/admin/adapters/adapterversion/add/").status_code == 403
    response = admin_client.post("/admin/adapters/adapterversion/add/",
                                 {"adapter": rejected.adapter_id, "number": 2, "status": "ready"})

    assert response.status_code == 403
    assert list(AdapterVersion.objects.values_list("number", flat=True)) == [1]


def test_the_adapter_form_lists_versions_read_only_and_ignores_a_posted_status(admin_client, rejected):
    url = f"/admin/adapters/adapter/{rejected.adapter_id}/change/"
    html = admin_client.get(url).content.decode()
    assert 'name="versions-0-status"' not in html
    assert "Rejected" in html

    response = admin_client.post(url, {
        "tenant": rejected.adapter.tenant_id, "name": "bot", "description": "edited", "base_model": "",
        "deployment-TOTAL_FORMS": 0, "deployment-INITIAL_FORMS": 0,
        "deployment-MIN_NUM_FORMS": 0, "deployment-MAX_NUM_FORMS": 1,
        "versions-TOTAL_FORMS": 2, "versions-INITIAL_FORMS": 1,
        "versions-MIN_NUM_FORMS": 0, "versions-MAX_NUM_FORMS": 1000,
        "versions-0-id": rejected.pk, "versions-0-adapter": rejected.adapter_id, "versions-0-status": "ready",
        "versions-1-adapter": rejected.adapter_id, "versions-1-number": 2, "versions-1-status": "ready",
    })

    assert response.status_code == 302  # the adapter itself saved
    assert Adapter.objects.get().description == "edited"
    rejected.refresh_from_db()
    assert rejected.status == AdapterVersion.Status.REJECTED
    assert AdapterVersion.objects.count() == 1

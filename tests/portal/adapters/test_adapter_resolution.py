"""Model ids resolve to a tenant's own ready adapter versions, and to nothing else."""

import pytest

from portal.adapters.models import Adapter, AdapterVersion
from portal.adapters.selectors import adapter_list_servable, adapter_version_resolve
from portal.tenants.services import tenant_create

pytestmark = pytest.mark.django_db


@pytest.fixture
def support(tenant) -> Adapter:
    adapter = Adapter.objects.create(tenant=tenant, name="support-bot")
    for number, status in ((1, "ready"), (2, "ready"), (3, "rejected")):
        AdapterVersion.objects.create(adapter=adapter, number=number, status=status, source_path=f"/a/{number}")
    return adapter


def test_name_resolves_to_the_newest_ready_version(tenant, support) -> None:
    resolved = adapter_version_resolve(tenant=tenant, model="acme/support-bot")
    assert resolved.version.number == 2 and resolved.public_id == "acme/support-bot"
    assert resolved.version.worker_name == f"lora-{resolved.version.uid.hex}"


def test_version_suffix_pins_a_version(tenant, support) -> None:
    assert adapter_version_resolve(tenant=tenant, model="acme/support-bot@v1").version.number == 1


@pytest.mark.parametrize(
    "model", ["acme/support-bot@v3", "acme/support-bot@v9", "acme/nope", "acme/support-bot@v0", "support-bot", "acme/", ""]
)
def test_unservable_ids_resolve_to_nothing(tenant, support, model) -> None:
    assert adapter_version_resolve(tenant=tenant, model=model) is None


def test_another_tenants_adapter_is_indistinguishable_from_a_missing_one(tenant, support) -> None:
    other = tenant_create(slug="globex", name="Globex")
    assert adapter_version_resolve(tenant=other, model="acme/support-bot") is None
    assert adapter_version_resolve(tenant=other, model="globex/support-bot") is None


def test_only_adapters_with_a_ready_version_are_listed(tenant, support) -> None:
    Adapter.objects.create(tenant=tenant, name="draft")  # no versions yet
    assert [a.public_id for a in adapter_list_servable(tenant=tenant)] == ["acme/support-bot"]

from itertools import count

import pytest

# The live gateway and its SmolLM2 worker (session-scoped, started only by the tests that ask).
from tests.portal.gateway.conftest import acme, gateway, gateway_port, live, worker  # noqa: F401

_ids = count()


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix):
    # Our own test database: other suites may be running at the same time on this machine.
    from django.conf import settings

    from tests.xdist_isolation import database_suffix

    database = settings.DATABASES["default"]
    database.setdefault("TEST", {})["NAME"] = f"test_{database['NAME']}_rollouts{database_suffix()}"


@pytest.fixture
def bot(tenant):
    """acme/bot with two ready versions (v1 serving, v2 the canary candidate)."""
    from portal.adapters.models import Adapter, AdapterVersion

    adapter = Adapter.objects.create(tenant=tenant, name="bot")
    for number in (1, 2):
        AdapterVersion.objects.create(adapter=adapter, number=number, source_path="/nonexistent",
                                      status=AdapterVersion.Status.READY)
    return adapter


@pytest.fixture
def record(tenant):
    """record(version=, created_at=, **fields): one ledger row of acme/bot served by `version`."""
    from django.utils import timezone

    from portal.usage.services import usage_record_create

    def make(*, version, created_at=None, **fields):
        created_at = created_at or timezone.now()
        fields.setdefault("request_id", f"req-{next(_ids)}")
        fields.setdefault("completion_id", f"chatcmpl-{next(_ids)}")
        return usage_record_create(tenant=tenant, model="acme/bot", adapter_version=version, created_at=created_at,
                                   finished_at=created_at, **fields)

    return make

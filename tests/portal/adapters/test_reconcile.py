"""After every fleet poll, a healthy worker that lacks deployed adapters gets them staged without
anyone asking: a restarted worker, a new pod, one back from an outage. Always-warm adapters first
and pinned; versions not deployed, retired or of a suspended tenant are left alone; work already
pending, or refused by that worker, is not repeated every poll; a worker whose adapter list could
not be read is not touched. Staging goes over real HTTP to loopback stand-in workers."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from portal.adapters import reconcile
from portal.adapters.models import AdapterVersion, Deployment
from portal.adapters.services import adapter_version_retire
from portal.fleet.models import InferenceWorker
from portal.fleet.signals import fleet_polled
from portal.tenants.models import Tenant
from portal.tenants.services import tenant_create
from tests.portal.adapters.test_staging import make_version
from tests.portal.adapters.test_staging_fakes import FakeWorker

pytestmark = [pytest.mark.django_db, pytest.mark.real_staging]


@pytest.fixture
def fake():
    worker = FakeWorker()
    yield worker
    worker.close()


@pytest.fixture
def deployed(tenant):
    """support (always-warm), sales: deployed; draft v1 superseded by v2 with weights {2: 100};
    a retired one; a suspended tenant's."""
    support = make_version(tenant, name="support", stored=False, source_path="/a/support")
    Deployment.objects.filter(adapter=support.adapter).update(always_warm=True)
    sales = make_version(tenant, name="sales", stored=False, source_path="/a/sales")
    old = make_version(tenant, name="draft", number=1, stored=False, source_path="/a/d1")
    new = make_version(tenant, name="draft", number=2, stored=False, source_path="/a/d2")
    Deployment.objects.filter(adapter=new.adapter).update(weights={"1": 0, "2": 100})
    return {"support": support, "sales": sales, "draft_v1": old, "draft_v2": new}


def came_up(url: str, **fields) -> InferenceWorker:
    return InferenceWorker.objects.create(url=url, healthy=True, **fields)


def test_a_worker_that_came_up_empty_gets_every_deployed_version_always_warm_first_and_pinned(
        deployed, fake, user, django_capture_on_commit_callbacks):
    retired = make_version(deployed["sales"].adapter.tenant, name="gone", stored=False, source_path="/a/gone")
    adapter_version_retire(version=retired, actor=user)
    suspended = tenant_create(slug="suspended", name="Suspended")
    make_version(suspended, name="bot", stored=False, source_path="/a/s")
    Tenant.objects.filter(pk=suspended.pk).update(status=Tenant.Status.SUSPENDED)
    worker = came_up(fake.url)

    with django_capture_on_commit_callbacks(execute=True):
        plan = reconcile.fleet_reconcile(workers=[worker], came_up={fake.url})

    expected = {deployed[n].worker_name for n in ("support", "sales", "draft_v2")}
    assert plan[fake.url][0] == deployed["support"].worker_name  # always-warm first
    assert set(plan[fake.url]) == expected and len(plan[fake.url]) == 3
    assert fake.loaded == expected
    assert fake.pinned == {deployed["support"].worker_name}
    for name in ("support", "sales", "draft_v2"):
        deployed[name].refresh_from_db()
        assert deployed[name].staging[fake.url]["status"] == "staged"


def test_a_worker_holding_them_in_any_tier_gets_nothing(deployed, fake):
    names = [deployed[n].worker_name for n in ("support", "sales", "draft_v2")]
    worker = came_up(fake.url, resident_adapters=dict(zip(names, ["device", "host", "disk"], strict=True)))

    assert reconcile.fleet_reconcile(workers=[worker], came_up={fake.url}) == {}
    assert fake.requests == []


def test_pending_work_is_not_repeated_until_it_is_stale_and_a_refusal_waits_for_a_restart(
        deployed, fake, django_capture_on_commit_callbacks):
    worker = came_up(fake.url)
    now = timezone.now()
    fresh, stale = now.isoformat(), (now - reconcile.PENDING_STALE_AFTER - timedelta(seconds=1)).isoformat()
    AdapterVersion.objects.filter(pk=deployed["support"].pk).update(
        staging={fake.url: {"status": "pending", "attempts": 1, "at": fresh}})
    AdapterVersion.objects.filter(pk=deployed["sales"].pk).update(
        staging={fake.url: {"status": "pending", "attempts": 1, "at": stale}})
    AdapterVersion.objects.filter(pk=deployed["draft_v2"].pk).update(
        staging={fake.url: {"status": "failed", "error": "HTTP 400: rank 64 exceeds --max-lora-rank"}})

    with django_capture_on_commit_callbacks(execute=False):
        steady = reconcile.fleet_reconcile(workers=[worker], now=now)
    assert steady == {fake.url: [deployed["sales"].worker_name]}

    with django_capture_on_commit_callbacks(execute=False):
        restarted = reconcile.fleet_reconcile(workers=[worker], came_up={fake.url}, now=now)
    assert restarted == {fake.url: [deployed["draft_v2"].worker_name]}  # sales is pending again now


def test_a_big_fleet_refills_a_worker_in_batches(deployed, fake, monkeypatch, django_capture_on_commit_callbacks):
    monkeypatch.setattr(reconcile, "RECONCILE_BATCH", 2)
    worker = came_up(fake.url)

    with django_capture_on_commit_callbacks(execute=False):
        first = reconcile.fleet_reconcile(workers=[worker])
        second = reconcile.fleet_reconcile(workers=[worker])

    assert len(first[fake.url]) == 2 and len(second[fake.url]) == 1
    assert set(first[fake.url]) | set(second[fake.url]) == {
        deployed[n].worker_name for n in ("support", "sales", "draft_v2")}


def test_the_poll_signal_reaches_only_healthy_workers_whose_list_was_read(
        deployed, fake, django_capture_on_commit_callbacks):
    listed = came_up(fake.url)
    unread = came_up("http://127.0.0.1:9")  # its adapter list was refused: what it holds is unknown
    down = InferenceWorker.objects.create(url="http://127.0.0.1:10", healthy=False)

    with django_capture_on_commit_callbacks(execute=False):
        fleet_polled.send(sender=InferenceWorker, workers=[listed, unread, down], came_up={fake.url},
                          listed={fake.url, down.url})

    for name in ("support", "sales", "draft_v2"):
        deployed[name].refresh_from_db()
        assert set(deployed[name].staging) == {fake.url}

"""Deployments: weights validated and audited, a deterministic per-request pick (90/10 over 1,000
request ids gives 90 ± 3 %), immediate rollback, @vN pinning, and the plan-gated always-warm flag
that stages and pins the deployed versions on (loopback stand-in) workers and unpins on disable."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from portal.adapters import deployments, traffic
from portal.adapters.limits import LimitExceeded
from portal.adapters.models import AdapterVersion, AuditEvent
from portal.adapters.services import adapter_version_retire
from portal.core.exceptions import InvalidInput
from portal.fleet.models import InferenceWorker
from portal.tenants.services import tenant_create
from tests.portal.adapters.test_staging import make_version
from tests.portal.adapters.test_staging_fakes import FakeWorker

pytestmark = [pytest.mark.django_db, pytest.mark.real_staging]


@pytest.fixture
def versions(tenant):
    """acme/bot v1..v4 ready, v5 rejected."""
    out = {n: make_version(tenant, number=n, stored=False, source_path=f"/a/v{n}") for n in range(1, 5)}
    out[5] = make_version(tenant, number=5, stored=False, status=AdapterVersion.Status.REJECTED)
    return out


@pytest.fixture
def adapter(versions):
    return versions[1].adapter


def picks(adapter, n=1000) -> Counter:
    return Counter(traffic.deployment_pick_version(adapter=adapter, request_id=f"req-{i}").number
                   for i in range(n))


def test_no_weights_pick_the_newest_ready_version(adapter):
    assert picks(adapter, 50) == {4: 50}


def test_canary_90_10_over_1000_requests_and_deterministic_per_request(adapter, user):
    deployments.deployment_set_weights(adapter=adapter, weights={3: 90, 4: 10}, actor=user)
    counts = picks(adapter)
    assert set(counts) == {3, 4} and 870 <= counts[3] <= 930, counts
    for _ in range(50):
        rid = str(uuid.uuid4())
        first = traffic.deployment_pick_version(adapter=adapter, request_id=rid)
        assert all(traffic.deployment_pick_version(adapter=adapter, request_id=rid) == first for _ in range(3))


def test_rollback_is_immediate(adapter, user):
    deployments.deployment_set_weights(adapter=adapter, weights={3: 50, 4: 50}, actor=user)
    deployments.deployment_set_weights(adapter=adapter, weights={3: 100}, actor=user)
    assert picks(adapter, 200) == {3: 200}
    deployments.deployment_set_weights(adapter=adapter, weights={}, actor=user)  # back to the newest
    assert picks(adapter, 200) == {4: 200}


def test_weights_are_audited_with_the_previous_ones(adapter, user):
    deployments.deployment_set_weights(adapter=adapter, weights={"3": 90, "v4": 10}, actor=user)
    deployments.deployment_set_weights(adapter=adapter, weights={2: 1}, actor=user)
    event = AuditEvent.objects.filter(action="deployment.weights_set").first()
    assert event.actor == user and event.target == "acme/bot"
    assert event.details == {"weights": {"2": 1}, "previous": {"3": 90, "4": 10}}
    adapter.deployment.refresh_from_db()
    assert adapter.deployment.weights == {"2": 1} and adapter.deployment.updated_by == user


@pytest.mark.parametrize(
    ("weights", "needle"),
    [
        ({5: 10}, "v5 is not a ready version"),  # rejected
        ({9: 10}, "v9 is not a ready version"),  # unknown
        ({3: -1}, "between 0 and"),
        ({3: 0, 4: 0}, "add up to more than 0"),
        ({3: 1.5}, "must be an integer"),
        ({3: True}, "must be an integer"),
        ({"x": 1}, "not a version number"),
        ({3: 10, "3": 5}, "given twice"),
        ([3, 4], "expected an object"),
    ],
)
def test_bad_weights_are_refused_and_change_nothing(adapter, user, weights, needle):
    deployments.deployment_set_weights(adapter=adapter, weights={3: 1}, actor=user)
    with pytest.raises(InvalidInput, match=needle) as e:
        deployments.deployment_set_weights(adapter=adapter, weights=weights, actor=user)
    assert e.value.field == "weights"
    adapter.deployment.refresh_from_db()
    assert adapter.deployment.weights == {"3": 1}


def test_a_retired_version_drops_out_of_the_split(adapter, versions, user):
    deployments.deployment_set_weights(adapter=adapter, weights={3: 90, 4: 10}, actor=user)
    adapter_version_retire(version=versions[4], actor=user)
    assert picks(adapter, 200) == {3: 200}
    adapter_version_retire(version=versions[3], actor=user)
    assert picks(adapter, 50) == {2: 50}  # nothing weighted left: the newest ready


def test_nothing_ready_picks_nothing(tenant):
    version = make_version(tenant, name="empty", status=AdapterVersion.Status.VALIDATING, stored=False)
    assert traffic.deployment_pick_version(adapter=version.adapter, request_id="r") is None


def test_resolve_pins_with_at_vn_and_picks_otherwise(tenant, adapter, user):
    deployments.deployment_set_weights(adapter=adapter, weights={2: 1}, actor=user)
    assert traffic.deployment_resolve(tenant=tenant, model="acme/bot", request_id="r").version.number == 2
    resolved = traffic.deployment_resolve(tenant=tenant, model="acme/bot@v3", request_id="r")
    assert resolved.version.number == 3 and resolved.public_id == "acme/bot@v3"
    for model in ("acme/bot@v5", "acme/nope", "other/bot", "bot", "acme/bot@v0"):
        assert traffic.deployment_resolve(tenant=tenant, model=model, request_id="r") is None
    other = tenant_create(slug="other", name="Other")
    assert traffic.deployment_resolve(tenant=other, model="acme/bot", request_id="r") is None


def test_resolve_splits_like_pick_in_one_query(tenant, adapter, user, django_assert_num_queries):
    deployments.deployment_set_weights(adapter=adapter, weights={3: 70, 4: 30}, actor=user)
    for i in range(200):
        rid = f"req-{i}"
        expected = traffic.deployment_pick_version(adapter=adapter, request_id=rid)
        with django_assert_num_queries(1):  # on every gateway request: versions + adapter + deployment
            resolved = traffic.deployment_resolve(tenant=tenant, model="acme/bot", request_id=rid)
        assert resolved.version == expected and resolved.version.adapter.tenant == tenant
    deployments.deployment_set_weights(adapter=adapter, weights={}, actor=user)  # no weights: the newest
    assert traffic.deployment_resolve(tenant=tenant, model="acme/bot", request_id="r").version.number == 4


# --- always-warm ---------------------------------------------------------------------------------


def test_always_warm_is_refused_on_the_free_plan(adapter, user):
    assert adapter.tenant.plan == "free"
    with pytest.raises(LimitExceeded, match="allows 0 always-warm") as e:
        deployments.deployment_set_always_warm(adapter=adapter, enabled=True, actor=user)
    assert e.value.status_code == 403 and e.value.field == "always_warm"
    adapter.deployment.refresh_from_db()
    assert adapter.deployment.always_warm is False


def test_the_team_plan_allows_two(tenant, user):
    tenant.plan = "team"
    tenant.save()
    adapters = [make_version(tenant, name=f"a{i}", stored=False, source_path="/x").adapter for i in range(3)]
    for adapter in adapters[:2]:
        deployments.deployment_set_always_warm(adapter=adapter, enabled=True, actor=user)
    with pytest.raises(LimitExceeded, match="allows 2 always-warm adapters and acme has 2"):
        deployments.deployment_set_always_warm(adapter=adapters[2], enabled=True, actor=user)
    deployments.deployment_set_always_warm(adapter=adapters[0], enabled=False, actor=user)
    deployments.deployment_set_always_warm(adapter=adapters[2], enabled=True, actor=user)
    assert AuditEvent.objects.filter(action="deployment.always_warm_set").count() == 4


@pytest.fixture
def fakes():
    workers = [FakeWorker(), FakeWorker()]
    for w in workers:
        InferenceWorker.objects.create(url=w.url, healthy=True)
    yield workers
    for w in workers:
        w.close()


def test_always_warm_stages_and_pins_the_deployed_versions_and_unpins_on_disable(
        tenant, adapter, versions, user, fakes, django_capture_on_commit_callbacks):
    tenant.plan = "enterprise"
    tenant.save()
    v3, v4 = versions[3], versions[4]
    with django_capture_on_commit_callbacks(execute=True):
        deployments.deployment_set_weights(adapter=adapter, weights={3: 90, 4: 10}, actor=user)
        deployments.deployment_set_always_warm(adapter=adapter, enabled=True, actor=user)
    for w in fakes:
        assert w.pinned == {v3.worker_name, v4.worker_name}
    v3.refresh_from_db()
    assert all(e["status"] == "staged" and e["pinned"] for e in v3.staging.values())

    # rollback to v3 only: v4 stays loaded but is no longer pinned
    with django_capture_on_commit_callbacks(execute=True):
        deployments.deployment_set_weights(adapter=adapter, weights={3: 100}, actor=user)
    for w in fakes:
        assert w.pinned == {v3.worker_name} and v4.worker_name in w.loaded

    with django_capture_on_commit_callbacks(execute=True):
        deployments.deployment_set_always_warm(adapter=adapter, enabled=False, actor=user)
    for w in fakes:
        assert w.pinned == set()


def test_a_pin_the_worker_refuses_is_recorded_but_the_version_stays_staged(
        tenant, adapter, versions, user, fakes, django_capture_on_commit_callbacks):
    from tests.portal.adapters.test_staging_fakes import error

    tenant.plan = "team"
    tenant.save()
    v4 = versions[4]
    fakes[0].script[f"/v1/adapters/{v4.worker_name}/pin"].append(
        (400, error("at most 2 adapters can be pinned (max_loras - 1)", code="too_many_pinned")))
    with django_capture_on_commit_callbacks(execute=True):
        deployments.deployment_set_always_warm(adapter=adapter, enabled=True, actor=user)
    v4.refresh_from_db()
    entry = v4.staging[fakes[0].url]
    assert entry["status"] == "staged" and entry["pinned"] is False and "too_many_pinned" not in entry["error"]
    assert entry["error"].startswith("pin: HTTP 400: at most 2 adapters")
    assert v4.staging[fakes[1].url]["pinned"] is True

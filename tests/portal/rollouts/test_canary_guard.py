"""The canary guard on ledger rows: a canary failing over min_requests is rolled back (weight 0,
an audit event with the figures, the banner), a healthy one is left alone, a slow one is rolled
back on its TTFT p95, thresholds outside their limits are refused."""

import pytest

from portal.adapters.deployments import deployment_get, deployment_set_weights
from portal.adapters.models import AuditEvent
from portal.core.exceptions import InvalidInput
from portal.rollouts.models import CanaryGuard
from portal.rollouts.selectors import rollback_banner
from portal.rollouts.services import canary_guard_check, canary_guard_dismiss, canary_guard_update
from portal.rollouts.tasks import canary_guard_check_task

pytestmark = pytest.mark.django_db


def traffic(record, version, *, n, errors=0, ttft=100.0):
    for i in range(n):
        if i < errors:
            record(version=version, status_code=400, error="adapter failed to load", error_code="adapter_load_failed")
        else:
            record(version=version, time_to_first_token_ms=ttft, prompt_tokens=10, completion_tokens=5)


def test_a_failing_canary_is_rolled_back_with_the_figures_and_a_banner(bot, record):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=None)
    canary_guard_update(deployment=deployment_get(adapter=bot), actor=None, min_requests=10)
    traffic(record, v1, n=40, errors=1)
    traffic(record, v2, n=9, errors=9)
    assert canary_guard_check_task() == 0  # 9 canary requests: too few to judge
    traffic(record, v2, n=1, errors=1)

    assert canary_guard_check_task() == 1
    assert deployment_get(adapter=bot).weights == {"1": 90, "2": 0}
    event = AuditEvent.objects.get(action="deployment.canary_rolled_back")
    assert event.target == "acme/bot@v2" and event.actor is None
    assert event.details["reasons"] == ["error_rate"]
    assert event.details["canary"]["requests"] == 10 and event.details["canary"]["errors"] == 10
    assert event.details["stable"]["requests"] == 40 and event.details["stable"]["errors"] == 1
    banner = rollback_banner(adapter=bot)
    assert banner["version"] == 2 and banner["canary"]["error_rate"] == 1.0
    assert canary_guard_check_task() == 0  # no canary any more

    canary_guard_dismiss(deployment=deployment_get(adapter=bot), actor=None)
    assert rollback_banner(adapter=bot) is None


def test_setting_weights_again_clears_the_banner_and_restarts_the_window(bot, record):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=None)
    canary_guard_update(deployment=deployment_get(adapter=bot), actor=None, min_requests=5)
    traffic(record, v1, n=5)
    traffic(record, v2, n=5, errors=5)
    assert canary_guard_check(deployment_id=deployment_get(adapter=bot).pk) == [2]
    assert rollback_banner(adapter=bot) is not None
    deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=None)  # a fixed v2, tried again
    assert rollback_banner(adapter=bot) is None
    # the old errors are before the canary's weight was set: not counted against it
    traffic(record, v2, n=5)
    assert canary_guard_check(deployment_id=deployment_get(adapter=bot).pk) == []
    assert deployment_get(adapter=bot).weights == {"1": 90, "2": 10}


def test_a_healthy_canary_is_left_alone(bot, record):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 80, 2: 20}, actor=None)
    traffic(record, v1, n=100, errors=2)
    traffic(record, v2, n=60, errors=3, ttft=150.0)  # 5% vs 2%: inside the 0.05 margin; 1.5x TTFT
    assert canary_guard_check_task() == 0
    assert deployment_get(adapter=bot).weights == {"1": 80, "2": 20}
    assert not AuditEvent.objects.filter(action="deployment.canary_rolled_back").exists()
    assert CanaryGuard.objects.get(deployment__adapter=bot).last_checked_at is not None


def test_a_slow_canary_is_rolled_back_on_ttft_p95(bot, record):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 80, 2: 20}, actor=None)
    traffic(record, v1, n=50, ttft=100.0)
    traffic(record, v2, n=50, ttft=250.0)
    assert canary_guard_check_task() == 1
    assert AuditEvent.objects.get(action="deployment.canary_rolled_back").details["reasons"] == ["ttft_p95"]


def test_a_disabled_guard_does_nothing(bot, record):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=None)
    canary_guard_update(deployment=deployment_get(adapter=bot), actor=None, enabled=False, min_requests=1)
    traffic(record, v2, n=5, errors=5)
    assert canary_guard_check_task() == 0
    assert deployment_get(adapter=bot).weights == {"1": 90, "2": 10}


@pytest.mark.parametrize(("field", "value"), [
    ("min_requests", 0), ("min_requests", 2.5), ("min_requests", True), ("error_rate_margin", -0.1),
    ("error_rate_margin", 1.5), ("error_rate_margin", float("nan")), ("ttft_p95_factor", 0.5),
    ("ttft_p95_factor", "2"), ("enabled", "yes"),
])
def test_bad_thresholds_are_refused_and_nothing_changes(bot, field, value):
    deployment = deployment_get(adapter=bot)
    canary_guard_update(deployment=deployment, actor=None, min_requests=20)
    with pytest.raises(InvalidInput) as info:
        # a good value alongside the bad one: neither is applied
        canary_guard_update(deployment=deployment, actor=None, **{"error_rate_margin": 0.2, field: value})
    assert info.value.field == field
    guard = CanaryGuard.objects.get(deployment=deployment)
    assert (guard.min_requests, guard.error_rate_margin, guard.ttft_p95_factor, guard.enabled) == (20, 0.05, 2.0, True)

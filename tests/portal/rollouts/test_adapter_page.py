"""The adapter page: the versions side by side with a chart per metric (data in a json_script
element), the rollback banner until dismissed, the guard's thresholds form (bad ones: 400 with
the reason, nothing saved; viewers cannot change them)."""

import json
import re

import pytest
from django.test import Client
from django.urls import reverse

from portal.adapters.deployments import deployment_get, deployment_set_weights
from portal.rollouts.models import CanaryGuard
from portal.rollouts.services import canary_guard_check, canary_guard_update
from portal.tenants.models import Membership
from portal.tenants.services import membership_create

pytestmark = pytest.mark.django_db


def login(django_user_model, tenant, name, role) -> Client:
    user = django_user_model.objects.create_user(username=name, password="pw")
    membership_create(tenant=tenant, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def member(django_user_model, tenant):
    return login(django_user_model, tenant, "mia", Membership.Role.MEMBER)


def page_url(bot, **params):
    url = reverse("console:adapter", kwargs={"slug": bot.tenant.slug, "name": bot.name})
    return url + ("?" + "&".join(f"{k}={v}" for k, v in params.items()) if params else "")


def test_versions_side_by_side_with_charts_and_the_rollback_banner(bot, record, member):
    v1, v2 = bot.versions.order_by("number")
    deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=None)
    canary_guard_update(deployment=deployment_get(adapter=bot), actor=None, min_requests=3)
    for _ in range(3):
        record(version=v1, time_to_first_token_ms=80.0, prompt_tokens=10, completion_tokens=6)
        record(version=v2, status_code=400, error="adapter failed to load", error_code="adapter_load_failed")
    html = member.get(page_url(bot, window="1h")).content.decode()
    assert 'id="compare-v1"' in html and 'id="compare-v2"' in html
    assert html.count("<canvas data-metric=") == 5
    data = json.loads(re.search(r'<script id="version-comparison-data" type="application/json">(.*?)</script>',
                                html, re.S).group(1))
    assert [s["label"] for s in data["series"]] == ["v1", "v2"]
    assert [v["requests"] for v in data["versions"]] == [3, 3] and data["versions"][1]["error_rate"] == 1.0
    assert "canary-rollback-banner" not in html

    assert canary_guard_check(deployment_id=deployment_get(adapter=bot).pk) == [2]
    html = member.get(page_url(bot)).content.decode()
    banner = re.search(r'id="canary-rollback-banner".*?</div>', html, re.S).group(0)
    assert "rolled back v2" in banner and "3 errors (100%)" in banner and "error_rate" in banner

    dismiss = reverse("console:adapter-canary-dismiss", kwargs={"slug": bot.tenant.slug, "name": bot.name})
    assert member.post(dismiss).status_code == 302
    assert "canary-rollback-banner" not in member.get(page_url(bot)).content.decode()


def test_an_unknown_window_falls_back_to_24h(bot, member):
    response = member.get(page_url(bot, window="5y"))
    assert response.status_code == 200 and '<option value="24h" selected>' in response.content.decode()


def test_thresholds_form_saves_and_refuses_bad_values(bot, member, django_user_model, tenant):
    url = reverse("console:adapter-canary-guard", kwargs={"slug": bot.tenant.slug, "name": bot.name})
    good = {"enabled": "on", "min_requests": "20", "error_rate_margin": "0.1", "ttft_p95_factor": "3"}
    assert member.post(url, good).status_code == 302
    guard = CanaryGuard.objects.get(deployment__adapter=bot)
    assert (guard.enabled, guard.min_requests, guard.error_rate_margin, guard.ttft_p95_factor) == (True, 20, 0.1, 3.0)

    bad = member.post(url, {**good, "min_requests": "5", "error_rate_margin": "1.5"})
    assert bad.status_code == 400
    assert "must be between 0 and 1" in bad.content.decode()
    assert member.post(url, {**good, "ttft_p95_factor": "fast"}).status_code == 400
    guard.refresh_from_db()
    assert (guard.min_requests, guard.error_rate_margin, guard.ttft_p95_factor) == (20, 0.1, 3.0)

    viewer = login(django_user_model, tenant, "vic", Membership.Role.VIEWER)
    assert viewer.post(url, {**good, "min_requests": "99"}).status_code == 403
    guard.refresh_from_db()
    assert guard.min_requests == 20

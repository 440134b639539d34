"""The canary guard over REST: read it with its defaults, change any threshold, bad values and
unknown settings are a 400 naming the field with nothing saved; viewers read only; another
tenant's adapter is a 404."""

import pytest
from django.test import Client
from django.urls import reverse

from portal.rollouts.models import CanaryGuard
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create

pytestmark = pytest.mark.django_db


def login(django_user_model, tenant, name, role) -> Client:
    user = django_user_model.objects.create_user(username=name, password="pw")
    membership_create(tenant=tenant, user=user, role=role)
    client = Client()
    client.force_login(user)
    return client


def url(slug: str, name: str) -> str:
    return reverse("api:adapter-canary-guard", kwargs={"tenant_slug": slug, "adapter_name": name})


def test_read_change_and_refuse_thresholds(bot, django_user_model, tenant):
    member = login(django_user_model, tenant, "mia", Membership.Role.MEMBER)
    got = member.get(url("acme", "bot")).json()
    assert (got["enabled"], got["min_requests"], got["error_rate_margin"], got["ttft_p95_factor"]) == (True, 50, 0.05, 2.0)

    changed = member.patch(url("acme", "bot"), {"min_requests": 200, "ttft_p95_factor": 1.5},
                           content_type="application/json")
    assert changed.status_code == 200 and changed.json()["min_requests"] == 200
    for body, field in (({"min_requests": "200"}, "min_requests"), ({"error_rate_margin": 2}, "error_rate_margin"),
                        ({"ttft_p95_factor": 0.9, "min_requests": 10}, "ttft_p95_factor"),
                        ({"enabled": 1}, "enabled"), ({"window": "1h"}, "window")):
        response = member.put(url("acme", "bot"), body, content_type="application/json")
        assert response.status_code == 400 and response.json()["field"] == field, response.content
    guard = CanaryGuard.objects.get(deployment__adapter=bot)
    assert (guard.min_requests, guard.ttft_p95_factor, guard.error_rate_margin) == (200, 1.5, 0.05)

    viewer = login(django_user_model, tenant, "vic", Membership.Role.VIEWER)
    assert viewer.get(url("acme", "bot")).status_code == 200
    assert viewer.patch(url("acme", "bot"), {"min_requests": 5}, content_type="application/json").status_code == 403
    assert member.get(url("acme", "nope")).status_code == 404
    other = tenant_create(slug="globex", name="Globex")
    outsider = login(django_user_model, other, "otto", Membership.Role.OWNER)
    assert outsider.get(url("acme", "bot")).status_code == 404

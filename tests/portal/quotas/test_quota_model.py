import pytest
from django.db import IntegrityError, transaction

from portal.core.exceptions import InvalidInput
from portal.keys.services import api_key_create
from portal.quotas.limits import Clock, format_duration
from portal.quotas.models import Quota
from portal.quotas.selectors import quota_scopes
from portal.quotas.services import quota_set


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "0s"),
        (-5, "0s"),
        (350, "350ms"),
        (1000, "1s"),
        (5001, "6s"),
        (60_000, "1m0s"),
        (62_000, "1m2s"),
        (3_600_000, "1h0m0s"),
        (3_905_000, "1h5m5s"),
    ],
)
def test_reset_durations_are_written_the_way_openai_writes_them(ms, text):
    assert format_duration(ms) == text


def test_the_next_month_rolls_over_the_year():
    clock = Clock.at(1924991999.0)  # 2030-12-31T23:59:59Z

    assert (clock.month, clock.next_month.isoformat()) == ("2030-12", "2031-01-01T00:00:00+00:00")
    assert clock.ms_to_next_month == 1000


@pytest.mark.django_db
def test_a_quota_belongs_to_exactly_one_tenant_or_key(tenant):
    api_key, _ = api_key_create(tenant=tenant, name="k")

    for owner in ({}, {"tenant": tenant, "api_key": api_key}):
        with pytest.raises(InvalidInput, match="exactly one"):
            quota_set(**owner, requests_per_minute=1)
        with transaction.atomic(), pytest.raises(IntegrityError):
            Quota.objects.create(**owner)


@pytest.mark.django_db
def test_quota_set_replaces_the_row_and_rejects_bad_limits(tenant):
    first = quota_set(tenant=tenant, requests_per_minute=5, tokens_per_minute=100)
    second = quota_set(tenant=tenant, max_concurrent_requests=2)

    assert second.pk == first.pk and Quota.objects.count() == 1
    assert (second.requests_per_minute, second.max_concurrent_requests) == (None, 2)
    with pytest.raises(InvalidInput, match="requests_per_minute"):
        quota_set(tenant=tenant, requests_per_minute=-1)
    with pytest.raises(InvalidInput, match="requests_per_hour"):
        quota_set(tenant=tenant, requests_per_hour=1)


@pytest.mark.django_db
def test_scopes_take_the_plan_under_null_tenant_fields_and_nothing_under_null_key_fields(tenant):
    api_key, _ = api_key_create(tenant=tenant, name="k")
    other_key, _ = api_key_create(tenant=tenant, name="other")
    quota_set(tenant=tenant, tokens_per_minute=123)
    quota_set(api_key=api_key, requests_per_minute=3)

    tenant_scope, key_scope = quota_scopes(tenant=tenant, api_key=api_key)
    (only_tenant,) = quota_scopes(tenant=tenant, api_key=other_key)

    assert (tenant_scope.requests_per_minute, tenant_scope.tokens_per_minute) == (60, 123)
    assert (tenant_scope.max_concurrent_requests, tenant_scope.monthly_token_budget) == (4, 2_000_000)
    assert (key_scope.scope, key_scope.requests_per_minute, key_scope.tokens_per_minute) == ("key", 3, None)
    assert key_scope.prefix.startswith(tenant_scope.prefix.removesuffix(":tenant"))  # one hash tag
    assert only_tenant == tenant_scope


@pytest.mark.django_db
def test_the_admin_lists_and_adds_quotas(admin_client, tenant):
    quota_set(tenant=tenant, requests_per_minute=7)

    listing = admin_client.get("/admin/quotas/quota/")
    added = admin_client.post(
        "/admin/quotas/quota/add/",
        {"tenant": "", "api_key": "", "requests_per_minute": "1"},
    )

    assert listing.status_code == 200 and b"tenant acme" in listing.content
    assert added.status_code == 200 and b"exactly one tenant or one API key" in added.content
    assert Quota.objects.count() == 1

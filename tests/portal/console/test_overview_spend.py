"""The tenant overview shows the monthly spend limit (USD, priced like the statement) next to
the token budget."""

from __future__ import annotations

import uuid

import pytest
from django.urls import reverse

from portal.quotas.services import quota_set
from portal.usage.services import usage_record_create

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def own_counters(settings):
    settings.QUOTA_KEY_PREFIX = f"test:console:{uuid.uuid4().hex}:"


def spend_section(client, tenant) -> str:
    html = client.get(reverse("console:overview", args=[tenant.slug])).content.decode()
    return html.split('<section id="spend-limit">', 1)[1].split("</section>", 1)[0]


def test_the_overview_shows_what_is_spent_of_the_limit(mia, tenant):
    quota_set(tenant=tenant, monthly_spend_limit="10.00")
    # the free plan: 0.10 USD per 1M prompt tokens, 0.30 per 1M completion tokens
    usage_record_create(request_id="r1", tenant=tenant, model="acme/bot", prompt_tokens=1_000_000,
                        completion_tokens=1_000_000)

    section = spend_section(mia, tenant)

    assert "$0.40 of $10.00 USD spent (4%)" in section and "limit is reached" not in section


def test_a_reached_limit_says_requests_are_refused(mia, tenant):
    quota_set(tenant=tenant, monthly_spend_limit="0.40")
    usage_record_create(request_id="r1", tenant=tenant, model="acme/bot", prompt_tokens=1_000_000,
                        completion_tokens=1_000_000)

    section = spend_section(mia, tenant)

    assert "(100%)" in section and "429 insufficient_quota" in section


def test_without_a_limit_the_overview_says_so(mia, tenant):
    assert "No monthly spend limit" in spend_section(mia, tenant)

"""The monthly spend limit (USD, priced by the tenant's plan like the statement), identical on the
Redis backend and the in-process one. The tenant fixture is on the free plan: 0.10 USD per 1M
prompt tokens, 0.30 USD per 1M completion tokens."""

from decimal import Decimal

import pytest
from asgiref.sync import sync_to_async

from portal.core.exceptions import InvalidInput
from portal.quotas.models import Quota
from portal.quotas.services import QuotaExceeded, quota_set, quota_settle, quota_usage
from portal.usage.billing import token_cost
from tests.portal.quotas.test_quota_admission import (
    aapi_key_create,
    admit,
    aquota_set,
    in_event_loop,
)

pytestmark = pytest.mark.django_db

aquota_usage = sync_to_async(quota_usage)
PROMPT, COMPLETION = Decimal("0.10"), Decimal("0.30")


@in_event_loop
async def test_settled_spend_is_the_statements_exact_price_of_the_tokens(backend, clock, tenant):
    admission = await admit(tenant, "a", tokens=1000)
    await quota_settle(admission=admission, prompt_tokens=613, completion_tokens=207)

    spend = (await aquota_usage(tenant=tenant))["monthly_spend_limit"]

    assert spend["used"] == token_cost(613, PROMPT) + token_cost(207, COMPLETION) == Decimal("0.0001234")
    assert (spend["limit"], spend["currency"], spend["month"]) == (None, "USD", "2031-05")


@in_event_loop
async def test_a_spent_limit_refuses_with_do_not_retry_and_what_is_left_still_fits(backend, clock, tenant):
    await aquota_set(tenant=tenant, monthly_spend_limit="0.0003")  # 1000 completion tokens' worth
    admission = await admit(tenant, "a", tokens=1000)  # estimated at the dearer price: 0.0003
    with pytest.raises(QuotaExceeded):
        await admit(tenant, "b", tokens=1)  # the estimate holds the whole limit until settled
    await quota_settle(admission=admission, prompt_tokens=1000, completion_tokens=0)  # 0.0001

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "c", tokens=667)  # 0.0002001 more would pass the limit

    error = refused.value
    assert (error.limit, error.scope, error.should_retry) == ("monthly_spend_limit", "tenant", False)
    assert error.headers["x-should-retry"] == "false"
    assert "0.0003 USD" in error.message and "0.0001 USD is spent" in error.message
    assert "resets at 2031-06-01T00:00:00Z" in error.message
    await admit(tenant, "d", tokens=666)  # 0.0001998: exactly what is left fits


@in_event_loop
async def test_a_keys_spend_limit_binds_that_key_only_and_the_month_starts_over(backend, clock, tenant):
    capped, _ = await aapi_key_create(tenant=tenant, name="capped")
    free, _ = await aapi_key_create(tenant=tenant, name="free")
    await aquota_set(api_key=capped, monthly_spend_limit=Decimal("0.00003"))  # 100 completion tokens
    await admit(tenant, "a", tokens=100, api_key=capped)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "b", tokens=1, api_key=capped)
    await admit(tenant, "c", tokens=10_000, api_key=free)

    assert (refused.value.limit, refused.value.scope) == ("monthly_spend_limit", "key")
    assert "API key 'capped'" in refused.value.message
    key_spend = (await aquota_usage(tenant=tenant, api_key=capped))["monthly_spend_limit"]
    assert (key_spend["used"], key_spend["limit"]) == (Decimal("0.00003"), Decimal("0.00003"))
    clock.advance(17 * 86400)  # June
    await admit(tenant, "d", tokens=100, api_key=capped)


@in_event_loop
async def test_a_zero_limit_refuses_everything(backend, clock, tenant):
    await aquota_set(tenant=tenant, monthly_spend_limit=0)

    with pytest.raises(QuotaExceeded) as refused:
        await admit(tenant, "a", tokens=1)

    assert refused.value.limit == "monthly_spend_limit"


@pytest.mark.parametrize(
    "value, message",
    [(0.5, "amount in USD"), ("-1", ">= 0"), ("lots", "not an amount"), ("NaN", ">= 0"), (True, "amount in USD")],
)
def test_a_bad_spend_limit_is_refused_naming_the_field(tenant, value, message):
    with pytest.raises(InvalidInput, match=message) as error:
        quota_set(tenant=tenant, monthly_spend_limit=value)

    assert error.value.field == "monthly_spend_limit"
    assert not Quota.objects.filter(tenant=tenant).exists()


def test_a_spend_limit_finer_than_a_micro_dollar_is_refused(tenant):
    with pytest.raises(InvalidInput) as error:
        quota_set(tenant=tenant, monthly_spend_limit="0.0000001")

    assert error.value.field == "monthly_spend_limit"

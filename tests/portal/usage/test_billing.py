"""Monthly statements: exact Decimal costs from plan prices, UTC month boundaries."""

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from portal.core.exceptions import InvalidInput
from portal.tenants.models import Tenant
from portal.tenants.services import tenant_create
from portal.usage.billing import money, statement_csv_rows, statement_for, token_cost

pytestmark = pytest.mark.django_db


def test_cost_is_exact_and_rounded_only_for_display():
    cost = token_cost(1_234_567, Decimal("0.10"))

    assert cost == Decimal("0.1234567")
    assert money(cost) == "0.12"
    assert money(Decimal("0.005")) == "0.01"  # half up
    assert money(token_cost(1_500_000_000_000, Decimal("0.30"))) == "450000.00"


def test_statement_lines_per_model_priced_by_the_plan(record, tenant):
    assert tenant.plan == Tenant.Plan.FREE  # 0.10 / 0.30 per 1M
    record(prompt_tokens=1_000_000, completion_tokens=234_567)
    record(prompt_tokens=234_567, completion_tokens=0, status_code=502, error="worker died")
    record(model="base", prompt_tokens=5, completion_tokens=5)

    statement = statement_for(tenant=tenant, year=2025, month=3)

    assert [line.model for line in statement.lines] == ["acme/bot", "base"]
    bot, base = statement.lines
    assert (bot.requests, bot.prompt_tokens, bot.completion_tokens) == (2, 1_234_567, 234_567)
    assert bot.prompt_cost == Decimal("0.1234567")
    assert bot.completion_cost == Decimal("0.0703701")
    assert bot.cost == Decimal("0.1938268")
    assert base.cost == Decimal("0.000002")
    assert statement.total_cost == Decimal("0.1938288")
    assert (statement.requests, statement.prompt_tokens, statement.completion_tokens) == (3, 1_234_572, 234_572)
    assert (statement.prompt_price_per_million, statement.completion_price_per_million) == (
        Decimal("0.10"),
        Decimal("0.30"),
    )


def test_totals_are_rounded_from_the_exact_sum_not_from_rounded_lines(record, tenant):
    # three lines of 0.004 each: 0.00 apiece on display, 0.01 together
    for model in ("a", "b", "c"):
        record(model=model, prompt_tokens=40_000)

    statement = statement_for(tenant=tenant, year=2025, month=3)
    rows = list(statement_csv_rows(statement))

    assert [row[-1] for row in rows[1:]] == ["0.00", "0.00", "0.00", "0.01"]
    assert statement.total_cost == Decimal("0.012")


def test_the_plan_sets_the_prices(record):
    enterprise = tenant_create(slug="big", name="Big", plan=Tenant.Plan.ENTERPRISE)
    record(tenant=enterprise, prompt_tokens=2_000_000, completion_tokens=1_000_000)

    statement = statement_for(tenant=enterprise, year=2025, month=3)

    assert statement.total_cost == Decimal("0.10") + Decimal("0.15")


def test_months_are_utc_calendar_months(record, tenant):
    record(created_at=datetime(2025, 2, 28, 23, 59, 59, 999999, tzinfo=UTC), prompt_tokens=1)
    record(created_at=datetime(2025, 3, 1, 0, 0, tzinfo=UTC), prompt_tokens=10)
    record(created_at=datetime(2025, 3, 31, 23, 59, 59, 999999, tzinfo=UTC), prompt_tokens=100)
    record(created_at=datetime(2025, 4, 1, 0, 0, tzinfo=UTC), prompt_tokens=1000)
    record(created_at=datetime(2024, 12, 31, 23, 0, tzinfo=UTC), prompt_tokens=10000)
    record(created_at=datetime(2025, 1, 1, 0, 0, tzinfo=UTC), prompt_tokens=100000)

    assert statement_for(tenant=tenant, year=2025, month=3).prompt_tokens == 110
    assert statement_for(tenant=tenant, year=2025, month=2).prompt_tokens == 1
    assert statement_for(tenant=tenant, year=2024, month=12).prompt_tokens == 10000
    assert statement_for(tenant=tenant, year=2025, month=1).prompt_tokens == 100000


def test_requests_refused_before_any_token_cost_nothing_and_stay_off_the_statement(record, tenant):
    record(model="other/x", prompt_tokens=0, completion_tokens=0, status_code=404, error="model not found")
    record(model="acme/bot", prompt_tokens=0, completion_tokens=0, status_code=429, error="quota")
    record(model="acme/bot", prompt_tokens=7, completion_tokens=0, status_code=499, error="client went away")

    statement = statement_for(tenant=tenant, year=2025, month=3)

    assert [(line.model, line.requests, line.prompt_tokens) for line in statement.lines] == [("acme/bot", 1, 7)]


def test_other_tenants_usage_is_not_on_the_statement(record, tenant):
    other = tenant_create(slug="other", name="Other")
    record(tenant=other, prompt_tokens=500)

    statement = statement_for(tenant=tenant, year=2025, month=3)

    assert statement.lines == () and statement.total_cost == Decimal(0)
    assert list(statement_csv_rows(statement)) == [next(statement_csv_rows(statement))]


@pytest.mark.parametrize(("year", "month"), [(2025, 0), (2025, 13), (0, 5)])
def test_a_month_that_does_not_exist_is_refused(tenant, year, month):
    with pytest.raises(InvalidInput):
        statement_for(tenant=tenant, year=year, month=month)

"""The staff billing dashboard sums the usage roll-ups, and must bill what each tenant's
statement (portal.usage.billing.statement_for, from the ledger) bills, to the digit; a row that
lands late in a bucket already rolled up (the spool replaying a day-old request) counts from the
next roll-up run (every minute on beat): the statement, read from the ledger, has it at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from portal.dashboards.selectors import billing_totals
from portal.tenants.services import tenant_create
from portal.usage.billing import money, statement_for
from portal.usage.rollups import usage_rollup_refresh
from portal.usage.services import usage_record_create

pytestmark = pytest.mark.django_db
NOW = datetime(2026, 11, 20, 12, 30, tzinfo=UTC)


def _record(tenant, n: int, at: datetime, *, prompt: int, completion: int, model: str = "m", **fields) -> None:
    usage_record_create(request_id=f"{tenant.slug}-{n}-{at.isoformat()}", tenant=tenant, model=model,
                        prompt_tokens=prompt, completion_tokens=completion, created_at=at, finished_at=at, **fields)


def test_the_dashboard_bills_what_the_statements_bill_from_roll_ups_and_the_live_tail():
    acme = tenant_create(slug="acme", name="Acme", plan="team")
    globex = tenant_create(slug="globex", name="Globex", plan="free")
    idle = tenant_create(slug="idle", name="Idle")
    for day in range(1, 20):  # rolled up by day, hour and minute
        at = datetime(2026, 11, day, 9, 15, tzinfo=UTC)
        _record(acme, 1, at, prompt=1_234_567 + day, completion=7_654_321 + day, model="acme/bot")
        _record(acme, 2, at, prompt=11, completion=0, model="base")
        _record(globex, 1, at, prompt=999, completion=1)
        # refused before a worker: no tokens, on no statement, still a request
        _record(acme, 3, at, prompt=0, completion=0, status_code=429, error="rate limited")
        _record(idle, 1, at, prompt=0, completion=0, status_code=404, error="no such model")
    _record(acme, 9, datetime(2026, 10, 31, 23, 59, tzinfo=UTC), prompt=5, completion=5)  # last month
    usage_rollup_refresh(now=NOW - timedelta(minutes=5))
    # after the last run: today's requests (the live tail, counted at once) and a late row for an
    # old day (counted from the next run)
    _record(acme, 4, NOW - timedelta(minutes=2), prompt=3, completion=4, model="acme/bot")
    _record(globex, 5, datetime(2026, 11, 3, 8, 0, tzinfo=UTC), prompt=100, completion=200)
    before = {t["slug"]: t for t in billing_totals(year=2026, month=11, now=NOW)["tenants"]}
    assert before["acme"]["requests"] == statement_for(tenant=acme, year=2026, month=11).requests
    assert before["globex"]["requests"] == statement_for(tenant=globex, year=2026, month=11).requests - 1
    usage_rollup_refresh(now=NOW)

    totals = billing_totals(year=2026, month=11, now=NOW)

    statements = {t.slug: statement_for(tenant=t, year=2026, month=11) for t in (acme, globex)}
    assert [t["slug"] for t in totals["tenants"]] == ["acme", "globex"]  # dearest first; idle billed nothing
    for row in totals["tenants"]:
        statement = statements[row["slug"]]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"], row["cost"]) == (
            statement.requests, statement.prompt_tokens, statement.completion_tokens, money(statement.total_cost))
    assert totals["total_cost"] == money(sum(s.total_cost for s in statements.values()))
    assert totals["total_tokens"] == sum(s.total_tokens for s in statements.values())


def test_a_month_not_begun_bills_nothing():
    acme = tenant_create(slug="acme", name="Acme")
    _record(acme, 1, NOW - timedelta(hours=1), prompt=10, completion=10)
    assert billing_totals(year=2026, month=12, now=NOW) == {
        "month": "2026-12", "tenants": [], "total_tokens": 0, "total_cost": "0.00"}

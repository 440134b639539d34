"""CSV exports: statement and raw ledger, for staff and the tenant's members only."""

import csv
import io
from datetime import UTC, datetime

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections
from django.shortcuts import resolve_url

from portal.tenants.services import membership_create, tenant_create
from portal.usage.billing import STATEMENT_CSV_HEADER
from portal.usage.views import RECORDS_CSV_HEADER

pytestmark = pytest.mark.django_db

STATEMENT = "/usage/acme/statement/2025-03.csv"
RECORDS = "/usage/acme/records.csv"


def _csv(response) -> list[list[str]]:
    body = b"".join(response.streaming_content) if response.streaming else response.content
    return list(csv.reader(io.StringIO(body.decode())))


@pytest.fixture
def member(client, user, tenant):
    membership_create(tenant=tenant, user=user)
    client.force_login(user)
    return client


@pytest.fixture
def outsider(client, django_user_model):
    other = tenant_create(slug="other", name="Other")
    someone = django_user_model.objects.create_user(username="eve", password="x")
    membership_create(tenant=other, user=someone)
    client.force_login(someone)
    return client


def test_member_gets_the_statement(member, record):
    record(prompt_tokens=1_234_567, completion_tokens=10)
    record(model="=cmd|' /C calc'!A0", prompt_tokens=1)

    response = member.get(STATEMENT)

    assert response.status_code == 200
    assert response["Content-Type"] == "text/csv"
    assert 'filename="acme-statement-2025-03.csv"' in response["Content-Disposition"]
    rows = _csv(response)
    assert rows[0] == STATEMENT_CSV_HEADER
    assert rows[1] == ["2025-03", "'=cmd|' /C calc'!A0", "1", "1", "0", "0.10", "0.30", "0.00", "0.00", "0.00"]
    assert rows[2] == ["2025-03", "acme/bot", "1", "1234567", "10", "0.10", "0.30", "0.12", "0.00", "0.12"]
    assert rows[3][:2] == ["2025-03", "TOTAL"] and rows[3][-1] == "0.12"
    assert len(rows) == 4


def test_an_empty_month_is_a_header_only_csv(member, record):
    record(created_at=datetime(2025, 4, 1, tzinfo=UTC))

    rows = _csv(member.get(STATEMENT))

    assert rows == [STATEMENT_CSV_HEADER]


@pytest.mark.parametrize("period", ["2025-13", "2025-00", "0000-01"])
def test_a_month_that_does_not_exist_is_404(member, period):
    assert member.get(f"/usage/acme/statement/{period}.csv").status_code == 404


@pytest.mark.parametrize("path", ["/usage/acme/statement/2025-3.csv", "/usage/acme/statement/25-03.csv"])
def test_a_malformed_period_is_404(member, path):
    assert member.get(path).status_code == 404


def test_another_tenants_member_gets_the_same_404_as_for_no_tenant(outsider, record):
    record(prompt_tokens=5)

    for path in (STATEMENT, RECORDS):
        denied = outsider.get(path)
        missing = outsider.get(path.replace("/acme/", "/nope/"))
        assert denied.status_code == missing.status_code == 404
        assert denied.content == missing.content


def test_anonymous_is_sent_to_log_in(client, tenant):
    for path in (STATEMENT, RECORDS):
        response = client.get(path)
        assert response.status_code == 302
        assert response["Location"].startswith(resolve_url(settings.LOGIN_URL) + "?next=")
        assert "next=" in response["Location"]


def test_staff_sees_any_tenant(client, django_user_model, tenant, record):
    staff = django_user_model.objects.create_user(username="ops", password="x", is_staff=True)
    client.force_login(staff)
    record(prompt_tokens=3)

    assert _csv(client.get(STATEMENT))[1][3] == "3"
    assert len(_csv(client.get(RECORDS))) == 2


def test_records_csv_streams_the_tenants_ledger_oldest_first(member, record, tenant):
    other = tenant_create(slug="other", name="Other")
    record(tenant=other, request_id="theirs")
    record(
        request_id="req-b",
        created_at=datetime(2025, 3, 11, tzinfo=UTC),
        prompt_tokens=2,
        completion_tokens=3,
        latency_ms=12.5,
        status_code=502,
        error="-worker died",
        client_disconnected=True,
        stream=True,
        constrained="json_schema",
    )
    record(request_id="req-a", created_at=datetime(2025, 3, 10, tzinfo=UTC), time_to_first_token_ms=4.0)

    response = member.get(RECORDS)

    assert response.status_code == 200 and response.streaming
    assert 'filename="acme-usage-records.csv"' in response["Content-Disposition"]
    rows = _csv(response)
    assert rows[0] == RECORDS_CSV_HEADER
    assert [row[0] for row in rows[1:]] == ["req-a", "req-b"]
    b = dict(zip(RECORDS_CSV_HEADER, rows[2], strict=True))
    assert b["created_at"] == "2025-03-11T00:00:00+00:00"
    assert (b["prompt_tokens"], b["completion_tokens"], b["latency_ms"], b["status_code"]) == ("2", "3", "12.5", "502")
    assert (b["error"], b["client_disconnected"], b["stream"], b["time_to_first_token_ms"]) == (
        "'-worker died",
        "true",
        "true",
        "",
    )
    assert b["constrained"] == "json_schema"
    assert dict(zip(RECORDS_CSV_HEADER, rows[1], strict=True))["constrained"] == ""


def test_records_csv_shows_the_worker_address_to_staff_only(client, member, record, django_user_model):
    record(request_id="req-w", worker_url="http://10.0.3.7:8001")

    as_member = dict(zip(RECORDS_CSV_HEADER, _csv(member.get(RECORDS))[1], strict=True))
    staff = django_user_model.objects.create_user(username="ops", password="x", is_staff=True)
    client.force_login(staff)
    as_staff = dict(zip(RECORDS_CSV_HEADER, _csv(client.get(RECORDS))[1], strict=True))

    assert as_member["request_id"] == "req-w" and as_member["worker_url"] == ""
    assert as_staff["worker_url"] == "http://10.0.3.7:8001"


def test_records_csv_pages_through_more_than_one_page(member, record, monkeypatch):
    monkeypatch.setattr("portal.usage.views.RECORDS_PAGE_SIZE", 2)
    same_instant = datetime(2025, 3, 10, tzinfo=UTC)
    for index in range(5):
        record(request_id=f"req-{index}", created_at=same_instant)

    rows = _csv(member.get(RECORDS))

    assert [row[0] for row in rows[1:]] == [f"req-{index}" for index in range(5)]


def test_records_csv_filters_by_days_and_refuses_bad_dates(member, record):
    record(request_id="early", created_at=datetime(2025, 3, 9, 23, 59, tzinfo=UTC))
    record(request_id="inside", created_at=datetime(2025, 3, 10, 8, tzinfo=UTC))
    record(request_id="late", created_at=datetime(2025, 3, 11, tzinfo=UTC))

    rows = _csv(member.get(RECORDS, {"start": "2025-03-10", "end": "2025-03-10"}))

    assert [row[0] for row in rows[1:]] == ["inside"]
    assert member.get(RECORDS, {"start": "yesterday"}).status_code == 400
    assert member.get(RECORDS, {"start": "2025-03-10", "end": "2025-03-01"}).status_code == 400


def test_records_csv_of_an_empty_ledger_is_header_only(member):
    assert _csv(member.get(RECORDS)) == [RECORDS_CSV_HEADER]


@pytest.fixture
def three_records_of_a_member(user, tenant, record):
    membership_create(tenant=tenant, user=user)
    for index in range(3):
        record(request_id=f"req-{index}")


@pytest.mark.django_db(transaction=True)
async def test_records_csv_streams_asynchronously_under_asgi(async_client, user, three_records_of_a_member, monkeypatch):
    monkeypatch.setattr("portal.usage.views.RECORDS_PAGE_SIZE", 2)
    await async_client.aforce_login(user)

    response = await async_client.get(RECORDS)

    assert response.status_code == 200 and response.is_async
    body = b"".join([chunk async for chunk in response.streaming_content]).decode()
    rows = list(csv.reader(io.StringIO(body)))
    assert [row[0] for row in rows] == ["request_id", "req-0", "req-1", "req-2"]
    # The test client keeps connections open after a request; close the worker thread's.
    await sync_to_async(connections.close_all)()

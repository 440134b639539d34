"""usage_record_create writes one row per request_id, however many callers race to write it."""

import threading
from datetime import UTC, datetime

import pytest
from django.db import connection

from portal.core.exceptions import InvalidInput
from portal.keys.services import api_key_create
from portal.tenants.services import tenant_create
from portal.usage.models import MODEL_MAX_LENGTH, UsageRecord
from portal.usage.services import usage_record_create


@pytest.mark.django_db
def test_record_is_written_with_every_field(tenant):
    api_key, _ = api_key_create(tenant=tenant, name="ci")
    started = datetime(2025, 3, 10, 12, 0, 0, tzinfo=UTC)
    finished = datetime(2025, 3, 10, 12, 0, 2, tzinfo=UTC)

    record = usage_record_create(
        request_id="req-1",
        tenant=tenant,
        api_key=api_key,
        model="acme/bot",
        worker_url="http://127.0.0.1:8001",
        stream=True,
        prompt_tokens=12,
        completion_tokens=34,
        time_to_first_token_ms=45.5,
        latency_ms=2000.0,
        finish_reason="stop",
        status_code=200,
        created_at=started,
        finished_at=finished,
    )

    stored = UsageRecord.objects.get()
    assert stored == record
    assert (stored.tenant, stored.api_key, stored.model, stored.stream) == (tenant, api_key, "acme/bot", True)
    assert (stored.prompt_tokens, stored.completion_tokens, stored.total_tokens) == (12, 34, 46)
    assert (stored.time_to_first_token_ms, stored.latency_ms) == (45.5, 2000.0)
    assert (stored.created_at, stored.finished_at) == (started, finished)
    assert not stored.is_error and not stored.client_disconnected


@pytest.mark.django_db
def test_a_second_call_returns_the_first_row_unchanged(tenant):
    first = usage_record_create(request_id="req-1", tenant=tenant, model="acme/bot", prompt_tokens=5)

    second = usage_record_create(request_id="req-1", tenant=tenant, model="acme/bot", prompt_tokens=999)

    assert second.pk == first.pk and second.prompt_tokens == 5
    assert UsageRecord.objects.count() == 1


@pytest.mark.django_db
def test_an_overlong_model_id_is_cut_and_missing_texts_are_blank(tenant):
    record = usage_record_create(
        request_id="req-1", tenant=tenant, model="x" * 5000, status_code=404, worker_url=None, error=None,
        finish_reason=None,
    )

    assert record.model == "x" * MODEL_MAX_LENGTH and record.is_error
    assert (record.worker_url, record.error, record.finish_reason) == ("", "", "")


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"request_id": ""}, "request_id"),
        ({"request_id": "r" * 201}, "request_id"),
        ({"prompt_tokens": -1}, "prompt_tokens"),
        ({"completion_tokens": 1.5}, "completion_tokens"),
        ({"cached_prompt_tokens": -3}, "cached_prompt_tokens"),
        ({"prompt_tokens": 10, "cached_prompt_tokens": 11}, "cached_prompt_tokens"),
        ({"constrained": "regex"}, "constrained"),
        ({"constrained": None}, "constrained"),
        ({"created_at": datetime(2025, 1, 1)}, "created_at"),
    ],
)
def test_bad_values_are_refused_by_name(tenant, fields, field):
    arguments = {"request_id": "req-1", "tenant": tenant, "model": "acme/bot", **fields}

    with pytest.raises(InvalidInput) as raised:
        usage_record_create(**arguments)

    assert raised.value.field == field
    assert not UsageRecord.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("constrained", ["", "json_object", "json_schema", "tools"])
def test_the_constrained_marker_is_stored(tenant, constrained):
    usage_record_create(request_id="req-1", tenant=tenant, model="acme/bot", constrained=constrained)

    assert UsageRecord.objects.get().constrained == constrained


@pytest.mark.django_db
def test_a_key_of_another_tenant_is_refused(tenant):
    other = tenant_create(slug="other", name="Other")
    api_key, _ = api_key_create(tenant=other, name="theirs")

    with pytest.raises(InvalidInput, match="api_key"):
        usage_record_create(request_id="req-1", tenant=tenant, api_key=api_key, model="acme/bot")


@pytest.mark.django_db(transaction=True)
def test_eight_threads_racing_on_one_request_id_write_one_row(tenant):
    assert connection.vendor == "postgresql"
    threads = 8
    barrier = threading.Barrier(threads)
    results: list[int] = []
    errors: list[BaseException] = []

    def write(index: int) -> None:
        try:
            barrier.wait(timeout=10)
            record = usage_record_create(
                request_id="req-race",
                tenant=tenant,
                model="acme/bot",
                prompt_tokens=index + 1,
                completion_tokens=7,
            )
            results.append(record.pk)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            connection.close()  # each thread has its own connection

    workers = [threading.Thread(target=write, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=30)

    assert errors == []
    assert len(results) == threads and len(set(results)) == 1
    stored = UsageRecord.objects.get(request_id="req-race")
    assert stored.pk == results[0]
    assert 1 <= stored.prompt_tokens <= threads  # one caller's values, whole
    assert UsageRecord.objects.count() == 1

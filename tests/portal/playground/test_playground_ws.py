"""The playground websocket: refused without a session or membership, the gateway's model
isolation and quotas, tokens streamed from a real worker, cancel aborting the worker's request,
and every request in the usage ledger once, with no API key."""

from __future__ import annotations

import asyncio

import pytest
from channels.db import database_sync_to_async

from portal.adapters.models import Adapter, AdapterVersion
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from portal.usage.models import UsageRecord
from tests.portal.playground.conftest import BASE, communicator, session_cookie, wait_until

HELLO = [{"role": "user", "content": "t5 t17 t42"}]


@pytest.fixture
def acme_member(live_worker, django_user_model):
    tenant = tenant_create(slug="acme", name="Acme", plan="enterprise")
    user = django_user_model.objects.create_user(username="ada", password="x")
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return user


@pytest.fixture
def cookie(acme_member) -> str:
    return session_cookie(acme_member)


async def receive_until(comm, kind: str, timeout: float = 30) -> list[dict]:
    """Messages up to and including the first of type `kind`."""
    messages = []
    while True:
        message = await comm.receive_json_from(timeout=timeout)
        messages.append(message)
        if message["type"] == kind:
            return messages


@database_sync_to_async
def rows(**filters) -> list[UsageRecord]:
    return list(UsageRecord.objects.filter(**filters).select_related("tenant"))


async def test_refused_without_a_session(live_worker):
    comm = communicator("acme")
    connected, code = await comm.connect()
    assert not connected and code == 4401


async def test_refused_for_non_members_and_foreign_origins(live_worker, cookie, django_user_model):
    other = await database_sync_to_async(tenant_create)(slug="globex", name="Globex")
    assert other.slug == "globex"
    for slug in ("globex", "no-such-tenant"):
        connected, code = await communicator(slug, cookie).connect()
        assert not connected and code == 4404
    connected, _ = await communicator("acme", cookie, origin=b"http://evil.example").connect()
    assert not connected
    comm = communicator("acme", cookie)
    connected, _ = await comm.connect()
    assert connected
    assert await comm.receive_json_from() == {"type": "ready", "tenant": "acme"}
    await comm.disconnect()


async def test_another_tenants_adapter_is_not_found(live_worker, cookie):
    @database_sync_to_async
    def seed():
        globex = tenant_create(slug="globex", name="Globex")
        secret = Adapter.objects.create(tenant=globex, name="secret")
        AdapterVersion.objects.create(adapter=secret, number=1, source_path="/nowhere")

    await seed()
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    for model in ("globex/secret", "globex/secret@v1"):
        await comm.send_json_to({"type": "chat", "model": model, "messages": HELLO, "max_tokens": 2})
        error = await comm.receive_json_from(timeout=20)
        assert error["type"] == "error" and error["status"] == 404 and error["code"] == "model_not_found"
        assert error["message"] == f"The model `{model}` does not exist or you do not have access to it."
    await comm.disconnect()
    refused = await rows(model__startswith="globex/")
    assert len(refused) == 2 and {r.status_code for r in refused} == {404}
    assert {(r.error_code, r.upstream_attempts) for r in refused} == {("model_not_found", 0)}
    assert all(r.api_key_id is None and r.tenant.slug == "acme" for r in await rows(model__startswith="globex/"))


async def test_chat_streams_deltas_and_writes_one_usage_row(live_worker, cookie):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO, "max_tokens": 6, "temperature": 0})
    messages = await receive_until(comm, "done", timeout=60)
    kinds = [m["type"] for m in messages]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("usage") == 1, kinds
    deltas = [m["text"] for m in messages if m["type"] == "delta"]
    assert len(deltas) >= 2 and all(isinstance(d, str) for d in deltas)
    usage = next(m for m in messages if m["type"] == "usage")
    assert usage["completion_tokens"] == 6 and usage["prompt_tokens"] > 0
    done = messages[-1]
    assert done["finish_reason"] == "length" and done["ttft_ms"] > 0 and done["tokens_per_second"] > 0
    request_id = messages[0]["request_id"]
    assert messages[0]["model"] == BASE

    # a second turn on the same socket works too
    await comm.send_json_to({"type": "chat", "model": BASE, "max_tokens": 2,
                             "messages": [*HELLO, {"role": "assistant", "content": "".join(deltas)},
                                          {"role": "user", "content": "t9"}]})
    assert (await receive_until(comm, "done", timeout=60))[-1]["finish_reason"] == "length"
    await comm.disconnect()

    row = await database_sync_to_async(wait_until)(lambda: UsageRecord.objects.select_related("tenant").filter(request_id=request_id).first())
    assert row.api_key_id is None and row.tenant.slug == "acme" and row.model == BASE and row.stream
    assert row.status_code == 200 and row.completion_tokens == 6 and row.finish_reason == "length"
    assert not row.client_disconnected and row.time_to_first_token_ms > 0
    assert row.worker_url == live_worker.url
    # the same ledger fields as /v1: the base has no adapter tier; the worker's queue time; six tokens' gaps
    assert row.adapter_tier == "" and row.error_code == "" and row.upstream_attempts == 1
    assert row.queue_ms is not None and 0 <= row.queue_ms <= row.latency_ms
    assert row.inter_token_ms is not None and 0 < row.inter_token_ms * 5 <= row.latency_ms
    await database_sync_to_async(wait_until)(lambda: UsageRecord.objects.count() == 2)


async def test_stop_aborts_the_generation_and_the_worker_request(live_worker, cookie):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO, "max_tokens": 240})
    start = await comm.receive_json_from(timeout=30)
    assert start["type"] == "start"
    first = await comm.receive_json_from(timeout=30)
    assert first["type"] == "delta"
    # busy: a second chat is refused while one runs
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO})
    await comm.send_json_to({"type": "cancel"})
    messages = await receive_until(comm, "cancelled", timeout=30)
    assert {"type": "error", "status": 409, "code": "busy",
            "message": "a generation is already running; stop it first"} in messages
    cancelled = messages[-1]
    assert cancelled == {"type": "cancelled", "column": 0, "request_id": start["request_id"],
                         "completion_id": cancelled["completion_id"]}
    assert cancelled["completion_id"].startswith("chatcmpl-")
    assert not [m for m in messages if m["type"] == "done"]

    await database_sync_to_async(wait_until)(
        lambda: live_worker.metric("vllm:num_requests_running") == 0
        and live_worker.metric("vllm:num_requests_waiting") == 0, timeout=15)
    row = await database_sync_to_async(wait_until)(
        lambda: UsageRecord.objects.select_related("tenant").filter(request_id=start["request_id"]).first())
    assert row.client_disconnected and row.api_key_id is None and row.status_code == 200
    assert 0 < row.completion_tokens < 240
    assert await database_sync_to_async(UsageRecord.objects.count)() == 1
    # nothing more arrives for the cancelled request; the socket still works
    assert await comm.receive_nothing(timeout=0.3)
    await comm.send_json_to({"type": "cancel"})
    assert await comm.receive_nothing(timeout=0.3)
    await comm.disconnect()


async def test_disconnect_mid_stream_aborts_too(live_worker, cookie):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO, "max_tokens": 240})
    start = await comm.receive_json_from(timeout=30)
    assert (await comm.receive_json_from(timeout=30))["type"] == "delta"
    await comm.disconnect()
    row = await database_sync_to_async(wait_until)(
        lambda: UsageRecord.objects.select_related("tenant").filter(request_id=start["request_id"]).first())
    assert row.client_disconnected
    await database_sync_to_async(wait_until)(lambda: live_worker.metric("vllm:num_requests_running") == 0,
                                             timeout=15)


async def test_same_quotas_as_the_api(live_worker, cookie):
    from portal.quotas.services import quota_set
    from portal.tenants.models import Tenant

    await database_sync_to_async(lambda: quota_set(tenant=Tenant.objects.get(slug="acme"), requests_per_minute=1))()
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO, "max_tokens": 1})
    assert (await receive_until(comm, "done", timeout=60))[-1]["type"] == "done"
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO, "max_tokens": 1})
    error = await comm.receive_json_from(timeout=20)
    assert error["type"] == "error" and error["status"] == 429 and error["code"] == "rate_limit_exceeded"
    await comm.disconnect()
    statuses = await database_sync_to_async(
        lambda: wait_until(lambda: sorted(UsageRecord.objects.values_list("status_code", "error_code"))
                           if UsageRecord.objects.count() == 2 else None))()
    assert statuses == [(200, ""), (429, "rate_limit_exceeded")]


async def test_bad_messages_and_viewers(live_worker, cookie, django_user_model):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await comm.send_to(text_data="not json")
    assert (await comm.receive_json_from())["code"] == "invalid_message"
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": "hi"})
    error = await comm.receive_json_from(timeout=20)
    assert error["status"] == 400 and "messages" in error["message"]
    await comm.disconnect()

    @database_sync_to_async
    def viewer():
        user = django_user_model.objects.create_user(username="vic", password="x")
        membership_create(tenant=acme_tenant(), user=user, role=Membership.Role.VIEWER)
        return session_cookie(user)

    comm = communicator("acme", await viewer())
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO})
    assert (await comm.receive_json_from())["code"] == "read_only"
    await comm.disconnect()
    await asyncio.sleep(0)


def acme_tenant():
    from portal.tenants.models import Tenant

    return Tenant.objects.get(slug="acme")


@pytest.fixture
def bot_version(live_worker, acme_member, tmp_path):
    """A ready version of acme/bot (PEFT files for the worker's shapes), not loaded anywhere yet."""
    from portal.fleet.models import InferenceWorker
    from portal.fleet.services import worker_poll
    from protocol.adapter_format import BaseShapes
    from tests.portal.adapters.peft_files import peft_config, write_peft

    row = worker_poll(worker=InferenceWorker.objects.create(url=live_worker.url, name="tiny"))
    assert row.healthy, row.last_error
    shapes = BaseShapes.from_config(row.base_config)
    targets = ["q_proj", "v_proj", "down_proj"]
    directory = write_peft(tmp_path / "bot", shapes, rank=8, targets=tuple(targets), seed=3,
                           config=peft_config(r=8, lora_alpha=16, target_modules=targets,
                                              base_model_name_or_path=shapes.name))
    bot = Adapter.objects.create(tenant=acme_tenant(), name="bot")
    return AdapterVersion.objects.create(adapter=bot, number=1, source_path=str(directory))


async def test_chat_with_an_adapter_loads_it_lazily_and_bills_the_version(live_worker, cookie, bot_version):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    answers = {}
    for model in (BASE, "acme/bot"):
        await comm.send_json_to({"type": "chat", "model": model, "messages": HELLO, "max_tokens": 6,
                                 "temperature": 0})
        messages = await receive_until(comm, "done", timeout=60)
        assert messages[0] == {"type": "start", "column": 0, "request_id": messages[0]["request_id"], "model": model}
        answers[model] = "".join(m["text"] for m in messages if m["type"] == "delta")
    await comm.disconnect()
    assert answers["acme/bot"] and answers["acme/bot"] != answers[BASE]
    row = await database_sync_to_async(wait_until)(
        lambda: UsageRecord.objects.filter(model="acme/bot").first())
    assert row.adapter_version_id == bot_version.pk and row.api_key_id is None and row.status_code == 200


async def test_membership_is_checked_again_for_every_chat(live_worker, cookie, acme_member):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    await comm.receive_json_from()
    await database_sync_to_async(lambda: Membership.objects.filter(user=acme_member).delete())()
    await comm.send_json_to({"type": "chat", "model": BASE, "messages": HELLO, "max_tokens": 1})
    assert (await comm.receive_json_from())["code"] == "not_found"
    assert (await comm.receive_output())["type"] == "websocket.close"
    assert await database_sync_to_async(UsageRecord.objects.count)() == 0

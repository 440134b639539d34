"""Side-by-side chat: one prompt streamed to up to three models at once over the one playground
websocket (the base and two versions of acme/bot on a real tiny worker). Each column is a
request of its own: its own request id, Stop, timings, errors, quota admission and ledger row.
A list the page should never send (too many, repeated, unknown models, a bad body) is refused
before any column starts."""

from __future__ import annotations

import pytest
from channels.db import database_sync_to_async

from portal.adapters.models import Adapter, AdapterVersion
from portal.tenants.models import Membership, Tenant
from portal.tenants.services import membership_create, tenant_create
from portal.usage.models import UsageRecord
from tests.portal.playground.conftest import BASE, communicator, session_cookie, wait_until

PROMPT = [{"role": "user", "content": "t5 t17 t42"}]
V1, V2 = "acme/bot@v1", "acme/bot@v2"


@pytest.fixture
def cookie(live_worker, django_user_model) -> str:
    tenant = tenant_create(slug="acme", name="Acme", plan="enterprise")
    user = django_user_model.objects.create_user(username="ada", password="x")
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return session_cookie(user)


@pytest.fixture
def bot_versions(live_worker, cookie, tmp_path) -> list[AdapterVersion]:
    """acme/bot v1 and v2: ready PEFT versions for the worker's shapes, different weights."""
    from portal.fleet.models import InferenceWorker
    from portal.fleet.services import worker_poll
    from protocol.adapter_format import BaseShapes
    from tests.portal.adapters.peft_files import peft_config, write_peft

    row = worker_poll(worker=InferenceWorker.objects.create(url=live_worker.url, name="tiny"))
    assert row.healthy, row.last_error
    shapes = BaseShapes.from_config(row.base_config)
    targets = ("q_proj", "v_proj", "down_proj")
    bot = Adapter.objects.create(tenant=Tenant.objects.get(slug="acme"), name="bot")
    versions = []
    for number, seed in ((1, 3), (2, 11)):
        directory = write_peft(tmp_path / f"bot-v{number}", shapes, rank=8, targets=targets, seed=seed,
                               config=peft_config(r=8, lora_alpha=16, target_modules=list(targets),
                                                  base_model_name_or_path=shapes.name))
        versions.append(AdapterVersion.objects.create(adapter=bot, number=number, source_path=str(directory),
                                                      status=AdapterVersion.Status.READY))
    return versions


async def connected(cookie: str):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    assert (await comm.receive_json_from())["type"] == "ready"
    return comm


async def receive_columns(comm, ends: dict[int, str], timeout: float = 60) -> list[dict]:
    """Messages until each column in `ends` got its last message of that type (done, cancelled,
    error)."""
    messages, waiting = [], dict(ends)
    while waiting:
        message = await comm.receive_json_from(timeout=timeout)
        messages.append(message)
        if waiting.get(message.get("column")) == message["type"]:
            del waiting[message["column"]]
    return messages


def of(messages: list[dict], column: int, kind: str | None = None) -> list[dict]:
    return [m for m in messages if m.get("column") == column and (kind is None or m["type"] == kind)]


@database_sync_to_async
def ledger(request_ids) -> dict[str, UsageRecord]:
    ids = set(request_ids)
    rows = wait_until(lambda: list(UsageRecord.objects.filter(request_id__in=ids))
                      if UsageRecord.objects.filter(request_id__in=ids).count() == len(ids) else None)
    return {row.request_id: row for row in rows}


@database_sync_to_async
def ledger_count() -> int:
    return UsageRecord.objects.count()


async def test_three_columns_stream_and_stop_one_while_the_others_finish(live_worker, cookie, bot_versions):
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "models": [BASE, V1, V2], "messages": PROMPT, "max_tokens": 120,
                             "temperature": 0})
    messages = []
    while not of(messages, 1, "delta"):  # v1 is streaming: stop it, and only it
        messages.append(await comm.receive_json_from(timeout=60))
    await comm.send_json_to({"type": "cancel", "column": 1})
    messages += await receive_columns(comm, {0: "done", 1: "cancelled", 2: "done"})
    await comm.disconnect()

    starts = {m["column"]: m for m in messages if m["type"] == "start"}
    assert {i: s["model"] for i, s in starts.items()} == {0: BASE, 1: V1, 2: V2}
    request_ids = [starts[i]["request_id"] for i in range(3)]
    assert len(set(request_ids)) == 3
    assert not of(messages, 1, "done") and not [m for m in messages if m["type"] == "error"]
    [cancelled] = of(messages, 1, "cancelled")
    assert cancelled["request_id"] == request_ids[1] and cancelled["completion_id"].startswith("chatcmpl-")
    answers = {}
    for i in (0, 2):
        [done] = of(messages, i, "done")
        assert done["request_id"] == request_ids[i] and done["finish_reason"] == "length"
        assert done["ttft_ms"] > 0 and done["tokens_per_second"] > 0
        assert done["completion_id"].startswith("chatcmpl-")
        assert of(messages, i, "usage")[0]["completion_tokens"] == 120
        answers[i] = "".join(m["text"] for m in of(messages, i, "delta"))
    assert answers[0] and answers[2] and answers[0] != answers[2]  # the base and v2 answer differently
    assert len({m["completion_id"] for m in messages if m["type"] in ("done", "cancelled")}) == 3
    # every message of a chat says its column: the page puts nothing in the wrong one
    assert all("column" in m for m in messages)

    # three requests through the gateway: three ledger rows, each billed to its own version
    rows = await ledger(request_ids)
    base, v1, v2 = (rows[r] for r in request_ids)
    assert (base.model, v1.model, v2.model) == (BASE, V1, V2)
    assert (base.adapter_version_id, v1.adapter_version_id, v2.adapter_version_id) == (
        None, bot_versions[0].pk, bot_versions[1].pk)
    assert all(r.api_key_id is None and r.status_code == 200 and r.stream for r in rows.values())
    assert v1.client_disconnected and 0 < v1.completion_tokens < 120
    assert not base.client_disconnected and not v2.client_disconnected
    assert base.completion_tokens == v2.completion_tokens == 120
    assert await ledger_count() == 3
    await database_sync_to_async(wait_until)(lambda: live_worker.metric("vllm:num_requests_running") == 0,
                                             timeout=15)


async def test_stop_without_a_column_stops_them_all_and_the_socket_goes_on(live_worker, cookie, bot_versions):
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "models": [BASE, V2], "messages": PROMPT, "max_tokens": 240})
    messages = []
    while not (of(messages, 0, "delta") and of(messages, 1, "delta")):
        messages.append(await comm.receive_json_from(timeout=60))
    # one chat at a time: a new one while columns run is refused, the running ones go on
    await comm.send_json_to({"type": "chat", "models": [BASE], "messages": PROMPT})
    await comm.send_json_to({"type": "cancel", "column": "first"})
    await comm.send_json_to({"type": "cancel"})
    messages = await receive_columns(comm, {0: "cancelled", 1: "cancelled"})
    errors = [m for m in messages if m["type"] == "error"]
    assert [(e["status"], e["code"]) for e in errors] == [(409, "busy"), (400, "invalid_message")]
    assert not any("column" in e for e in errors) and not [m for m in messages if m["type"] == "done"]

    # a single-model chat on the same socket is a column of its own
    await comm.send_json_to({"type": "chat", "models": [V1], "messages": PROMPT, "max_tokens": 3})
    messages = await receive_columns(comm, {0: "done"})
    assert messages[0]["type"] == "start" and messages[0]["model"] == V1
    await comm.disconnect()
    statuses = await database_sync_to_async(
        lambda: wait_until(lambda: sorted(UsageRecord.objects.values_list("model", "client_disconnected"))
                           if UsageRecord.objects.count() == 3 else None))()
    assert statuses == [(V1, False), (V2, True), (BASE, True)]


async def test_a_columns_quota_refusal_is_its_own(live_worker, cookie, bot_versions):
    """Each column is admitted on its own: with room for two requests a minute, two of the
    three stream and the third says 429 in its column; three ledger rows."""
    from portal.quotas.services import quota_set

    await database_sync_to_async(lambda: quota_set(tenant=Tenant.objects.get(slug="acme"), requests_per_minute=2))()
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "models": [BASE, V1, V2], "messages": PROMPT, "max_tokens": 4})
    messages = []
    while len([m for m in messages if m["type"] in ("done", "error")]) < 3:
        messages.append(await comm.receive_json_from(timeout=60))
    await comm.disconnect()
    [error] = [m for m in messages if m["type"] == "error"]
    assert (error["status"], error["code"]) == (429, "rate_limit_exceeded") and error["column"] in (0, 1, 2)
    refused = error["column"]
    assert not of(messages, refused, "start") and not of(messages, refused, "delta")
    assert sorted(m["column"] for m in messages if m["type"] == "done") == sorted({0, 1, 2} - {refused})
    statuses = await database_sync_to_async(
        lambda: wait_until(lambda: sorted(UsageRecord.objects.values_list("status_code", flat=True))
                           if UsageRecord.objects.count() == 3 else None))()
    assert statuses == [200, 200, 429]


async def test_a_broken_version_fails_in_its_column_only(live_worker, cookie, bot_versions):
    """v2's weights were damaged after it validated: the worker refuses to load it, v2's column
    says so, the base and v1 answer; the ledger has v2's failure against v2."""
    from pathlib import Path

    (Path(bot_versions[1].source_path) / "adapter_model.safetensors").write_bytes(b"not safetensors")
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "models": [BASE, V1, V2], "messages": PROMPT, "max_tokens": 4})
    messages = await receive_columns(comm, {0: "done", 1: "done", 2: "error"})
    await comm.disconnect()
    [error] = [m for m in messages if m["type"] == "error"]
    assert error["column"] == 2 and error["status"] == 400 and error["code"] == "adapter_load_failed"
    assert V2 in error["message"] and error["param"] == "model"
    assert not of(messages, 2, "start")
    rows = await database_sync_to_async(
        lambda: wait_until(lambda: {r.model: r for r in UsageRecord.objects.all()}
                           if UsageRecord.objects.count() == 3 else None))()
    assert rows[V2].status_code == 400 and rows[V2].adapter_version_id == bot_versions[1].pk
    assert rows[V2].error_code == "adapter_load_failed"
    assert rows[BASE].status_code == rows[V1].status_code == 200


@pytest.mark.parametrize(("models", "status", "param", "says"), [
    ([BASE, V1, V2, "acme/bot"], 400, "models", "at most 3 models side by side, got 4"),
    ([BASE, V1, BASE], 400, "models", f"`{BASE}` is listed twice"),
    ([BASE, "acme/nope"], 404, "models", "The model `acme/nope` does not exist"),
    ([V1, "globex/secret"], 404, "models", "The model `globex/secret` does not exist"),
    ([], 400, "models", "must be a list of 1 to 3 model ids"),
    ("tiny-base", 400, "models", "must be a list of 1 to 3 model ids"),
    ([BASE, 7], 400, "models", "each entry must be a non-empty model id"),
])
async def test_bad_model_lists_are_refused_before_anything_starts(live_worker, cookie, bot_versions,
                                                                   models, status, param, says):
    await database_sync_to_async(tenant_create)(slug="globex", name="Globex")
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "models": models, "messages": PROMPT, "max_tokens": 2})
    error = await comm.receive_json_from(timeout=20)
    assert error["type"] == "error" and (error["status"], error["param"]) == (status, param), error
    assert says in error["message"] and "column" not in error
    assert await comm.receive_nothing(timeout=0.5)  # no column started
    # the socket is still usable, and nothing ran: no ledger row, no quota spent
    await comm.send_json_to({"type": "chat", "models": [BASE, V1], "messages": "hi"})
    error = await comm.receive_json_from(timeout=20)
    assert (error["status"], error["param"], "column" in error) == (400, "messages", False), error
    assert await comm.receive_nothing(timeout=0.3)
    await comm.disconnect()
    assert await ledger_count() == 0


async def test_thumbs_up_and_down_per_answer(live_worker, cookie, bot_versions, django_user_model):
    from portal.rollouts.models import Feedback

    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "models": [V1, V2], "messages": PROMPT, "max_tokens": 2})
    messages = await receive_columns(comm, {0: "done", 1: "done"})
    ids = [of(messages, i, "done")[0]["completion_id"] for i in (0, 1)]
    for completion_id, rating in ((ids[0], "up"), (ids[1], "up"), (ids[1], "down")):  # the last replaces
        await comm.send_json_to({"type": "feedback", "completion_id": completion_id, "rating": rating})
        assert await comm.receive_json_from(timeout=20) == {"type": "feedback", "completion_id": completion_id,
                                                           "rating": rating}
    # bad ratings and ids: an error naming the answer, nothing recorded
    for feedback, status, code in (({"completion_id": ids[0], "rating": "meh"}, 400, "invalid_feedback"),
                                   ({"completion_id": "chatcmpl-nope", "rating": "up"}, 404, "completion_not_found"),
                                   ({"rating": "up"}, 400, "invalid_feedback")):
        await comm.send_json_to({"type": "feedback", **feedback})
        error = await comm.receive_json_from(timeout=20)
        assert (error["type"], error["status"], error["code"]) == ("error", status, code), error
        assert error.get("completion_id") == feedback.get("completion_id") and "column" not in error
    await comm.disconnect()

    @database_sync_to_async
    def recorded():
        return {(f.completion_id, f.rating, f.source, f.adapter_version_id, f.user.username)
                for f in Feedback.objects.select_related("user")}

    assert await recorded() == {(ids[0], "up", "playground", bot_versions[0].pk, "ada"),
                                (ids[1], "down", "playground", bot_versions[1].pk, "ada")}

    @database_sync_to_async
    def viewer_cookie():
        user = django_user_model.objects.create_user(username="vic", password="x")
        membership_create(tenant=Tenant.objects.get(slug="acme"), user=user, role=Membership.Role.VIEWER)
        return session_cookie(user)

    comm = await connected(await viewer_cookie())
    await comm.send_json_to({"type": "feedback", "completion_id": ids[0], "rating": "down"})
    error = await comm.receive_json_from(timeout=20)
    assert (error["code"], error["completion_id"]) == ("read_only", ids[0])
    await comm.disconnect()
    assert len(await recorded()) == 2

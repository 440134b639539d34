"""The playground's structured-output boxes: a JSON schema makes the chat a response_format
json_schema request whose answer matches it, a tools list with tool_choice "required" shows the
answer's tool calls, and a box that is not JSON is said in the page with nothing sent (no request,
no ledger row). The chats run on SmolLM2 (the gateway tests' worker), not on the playground's tiny
word-level worker, which cannot spell JSON."""

from __future__ import annotations

import json
import uuid

import jsonschema
import pytest
from channels.db import database_sync_to_async

from portal.gateway.errors import GatewayError
from portal.playground.services import SCHEMA_NAME, playground_constraints
from portal.tenants.models import Membership
from portal.tenants.services import membership_create, tenant_create
from portal.usage.models import UsageRecord
from tests.portal.gateway.conftest import ADMIN_TOKEN, start_worker
from tests.portal.playground.conftest import communicator, session_cookie, wait_until

SMOL = "smollm2"  # the served model name tests.portal.gateway.conftest.start_worker gives
ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def smol_worker(tmp_path_factory):
    proc = start_worker(tmp_path_factory, "playground-structured")
    yield proc
    proc.stop()


@pytest.fixture
def on_smol(smol_worker, transactional_db, settings):
    """The playground routed to SmolLM2 (as conftest.live_worker does to the tiny worker)."""
    from portal.gateway.resolve import base_model_forget

    settings.INFERENCE_URLS = [smol_worker.url]
    settings.INFERENCE_ADMIN_TOKEN = ADMIN_TOKEN
    settings.QUOTA_KEY_PREFIX = f"test:playground:{uuid.uuid4().hex}:"
    base_model_forget()
    return smol_worker


@pytest.fixture
def cookie(on_smol, django_user_model) -> str:
    tenant = tenant_create(slug="acme", name="Acme", plan="enterprise")
    user = django_user_model.objects.create_user(username="ada", password="x")
    membership_create(tenant=tenant, user=user, role=Membership.Role.MEMBER)
    return session_cookie(user)


async def connected(cookie: str):
    comm = communicator("acme", cookie)
    assert (await comm.connect())[0]
    assert (await comm.receive_json_from())["type"] == "ready"
    return comm


async def receive_until(comm, kind: str, timeout: float = 120) -> list[dict]:
    messages = []
    while True:
        messages.append(await comm.receive_json_from(timeout=timeout))
        if messages[-1]["type"] in (kind, "error"):
            return messages


def ledger_row(request_id: str) -> UsageRecord:
    return wait_until(lambda: UsageRecord.objects.filter(request_id=request_id).first())


# -- the boxes as request fields --------------------------------------------------------------------
def test_the_boxes_become_request_fields():
    assert playground_constraints() == {}
    assert playground_constraints(json_schema="  ", tools="", tool_choice="none") == {}
    assert playground_constraints(json_schema=json.dumps(SCHEMA)) == {"response_format": {
        "type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": SCHEMA, "strict": True}}}
    as_tool = {"type": "function", "function": WEATHER}
    for box in (json.dumps([WEATHER]), json.dumps(WEATHER), json.dumps([as_tool])):
        assert playground_constraints(tools=box) == {"tools": [as_tool], "tool_choice": "required",
                                                     "parallel_tool_calls": False}
    assert playground_constraints(tools=json.dumps([WEATHER]), tool_choice="none") == {"tools": [as_tool],
                                                                                       "tool_choice": "none"}


@pytest.mark.parametrize(("boxes", "param", "fragment"), [
    ({"json_schema": '{"type": "object",'}, "json_schema", "The JSON schema is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema", "must be a JSON object"),
    ({"json_schema": {"type": "object"}}, "json_schema", "the box's text"),
    ({"tools": "[{name: f}]"}, "tools", "Tools is not valid JSON"),
    ({"tools": "[]"}, "tools", "non-empty JSON list"),
    ({"tools": '[{"description": "no name"}]'}, "tools", "Tools[0] needs a function name"),
    ({"tools": json.dumps([WEATHER]), "tool_choice": "auto"}, "tool_choice", "required, none"),
])
def test_a_box_that_is_not_what_it_should_be_is_a_400_naming_it(boxes, param, fragment):
    with pytest.raises(GatewayError) as info:
        playground_constraints(**boxes)

    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in info.value.message and info.value.message.endswith("nothing was sent.")


# -- through the websocket ----------------------------------------------------------------------------
async def test_invalid_json_in_the_schema_box_is_said_and_nothing_is_sent(cookie):
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "model": SMOL, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2, "json_schema": '{"type": "object", "properties": '})
    error = await comm.receive_json_from(timeout=20)

    assert error["type"] == "error" and (error["status"], error["param"]) == (400, "json_schema")
    assert error["message"].startswith("The JSON schema is not valid JSON (")
    assert await comm.receive_nothing(timeout=0.3)  # no start: the gateway was never asked
    # the socket still works, and only the chat that ran is in the ledger
    await comm.send_json_to({"type": "chat", "model": SMOL, "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 2})
    assert (await receive_until(comm, "done"))[-1]["type"] == "done"
    await comm.disconnect()
    rows = await database_sync_to_async(lambda: wait_until(lambda: list(UsageRecord.objects.all())))()
    assert len(rows) == 1 and rows[0].constrained == ""


async def test_a_schema_in_the_box_shapes_the_answer(cookie):
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "model": SMOL, "messages": ASK, "max_tokens": 48, "temperature": 0,
                             "json_schema": json.dumps(SCHEMA, indent=2)})
    messages = await receive_until(comm, "done")
    await comm.disconnect()

    assert messages[-1]["type"] == "done" and messages[-1]["finish_reason"] == "stop", messages
    answer = "".join(m["text"] for m in messages if m["type"] == "delta")
    jsonschema.validate(json.loads(answer), SCHEMA)
    assert not [m for m in messages if m["type"] == "tool_calls"]
    row = await database_sync_to_async(ledger_row)(messages[0]["request_id"])
    assert (row.constrained, row.status_code, row.api_key_id) == ("json_schema", 200, None)


async def test_a_forced_tool_call_is_shown(cookie):
    comm = await connected(cookie)
    await comm.send_json_to({"type": "chat", "model": SMOL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
                             "max_tokens": 48, "temperature": 0, "tools": json.dumps([WEATHER]),
                             "tool_choice": "required"})
    messages = await receive_until(comm, "done")
    await comm.disconnect()

    kinds = [m["type"] for m in messages]
    assert kinds[-1] == "done" and messages[-1]["finish_reason"] == "tool_calls", messages
    assert kinds.index("tool_calls") < kinds.index("done") and messages[-1]["ttft_ms"] > 0
    [call] = next(m for m in messages if m["type"] == "tool_calls")["tool_calls"]  # one call per answer
    assert call["type"] == "function" and call["id"] and call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["parameters"])
    row = await database_sync_to_async(ledger_row)(messages[0]["request_id"])
    assert (row.constrained, row.finish_reason, row.status_code) == ("tools", "tool_calls", 200)
    assert row.completion_tokens > 0

"""Input that once got Django's HTML 500 is a 400 in OpenAI's shape naming the parameter, with its
ledger row: output bounds past int64, lone surrogate escapes, a NUL in the model id; and fields
the platform does not implement are refused by name rather than silently ignored (structured
output and tool calls, which it does, are in test_gateway_structured)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.portal.gateway.conftest import BASE, sdk

MESSAGES = [{"role": "user", "content": "Hi"}]


def post_raw(live, key: str, raw: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{live.url}{path}", content=raw, timeout=60,
                      headers={"authorization": f"Bearer {key}", "content-type": "application/json"})


def assert_400(response: httpx.Response, param: str, fragment: str):
    from portal.usage.models import UsageRecord

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    row = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert row.status_code == 400
    return row


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_an_output_bound_past_int64_is_a_400(live, acme, name):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "%s": 9223372036854775808}' % (
        BASE.encode(), name.encode())

    assert_400(post_raw(live, acme.key, raw), name, "at most 2147483647")


def test_a_lone_surrogate_is_a_400_naming_where_it_is(live, acme):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "caf\\ud800e"}]}' % BASE.encode()

    assert_400(post_raw(live, acme.key, raw), "messages[0].content", "surrogate")


def test_a_nul_in_the_model_is_a_400_and_its_row_is_stored(live, acme):
    raw = b'{"model": "%s\\u0000x", "messages": [{"role": "user", "content": "Hi"}]}' % BASE.encode()

    row = assert_400(post_raw(live, acme.key, raw), "model", "control characters")
    assert row.model == f"{BASE}\ufffdx"


@pytest.mark.parametrize(("param", "value"), [
    ("functions", [{"name": "f", "parameters": {"type": "object"}}]),
    ("prediction", {"type": "content", "content": "Hello"}),
    ("web_search_options", {}),
])
def test_an_unsupported_field_is_refused_by_name(live, acme, param, value):
    with pytest.raises(openai.BadRequestError) as info:
        sdk(live, acme.key).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2, **{param: value})

    assert info.value.body["param"] == param


def test_harmless_values_of_those_fields_are_accepted(live, acme):
    answer = sdk(live, acme.key).chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2,
                                                         response_format={"type": "text"}, logit_bias={})

    assert answer.choices[0].finish_reason in ("length", "stop")

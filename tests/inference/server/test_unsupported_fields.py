"""OpenAI parameters the worker does not implement (legacy functions, audio, predictions, search)
are refused with a 400 naming the parameter, through the official openai SDK, instead of a 200
with plain text that ignored them; values that ask for nothing are served as usual."""

from __future__ import annotations

import openai
import pytest

from protocol.worker_api import UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_COMPLETION_FIELDS
from tests.inference.server.conftest import SERVED

HI = [{"role": "user", "content": "Hi"}]
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {"type": "object"}}}

CHAT_ASKS = [
    ("functions", {"functions": [WEATHER_TOOL["function"]]}),
    ("function_call", {"function_call": {"name": "get_weather"}}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("prediction", {"prediction": {"type": "content", "content": "Hello"}}),
    ("web_search_options", {"web_search_options": {}}),
]
# Values that ask for nothing, of the unsupported fields and of the served tool / format fields.
CHAT_HARMLESS = [
    {"tools": []}, {"tool_choice": "none"}, {"parallel_tool_calls": True}, {"functions": []},
    {"function_call": "none"}, {"response_format": {"type": "text"}}, {"logit_bias": {}}, {"modalities": ["text"]},
    {"tools": [WEATHER_TOOL], "tool_choice": "none"},
    {"extra_body": {name: None for name in (*UNSUPPORTED_CHAT_FIELDS, "tools", "tool_choice", "response_format",
                                            "logit_bias", "parallel_tool_calls")}},
]


def test_every_unsupported_chat_field_is_exercised():
    assert {name for name, _ in CHAT_ASKS} == set(UNSUPPORTED_CHAT_FIELDS)
    assert set(UNSUPPORTED_COMPLETION_FIELDS) <= set(UNSUPPORTED_CHAT_FIELDS)


def _refused(error: openai.BadRequestError, param: str) -> None:
    assert error.status_code == 400
    body = error.body
    assert body["param"] == param and body["code"] == "unsupported_parameter", body
    assert body["type"] == "invalid_request_error"
    assert body["message"].startswith(f"{param}: not supported yet"), body


@pytest.mark.parametrize(("param", "kwargs"), CHAT_ASKS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_ASKS)])
def test_chat_refuses_what_it_would_ignore(client, param, kwargs):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SERVED, messages=HI, max_tokens=1, stream=stream, **kwargs)
        _refused(e.value, param)


def test_chat_serves_values_that_ask_for_nothing(client):
    plain = client.chat.completions.create(model=SERVED, messages=HI, max_tokens=3, temperature=0)
    for kwargs in CHAT_HARMLESS:
        r = client.chat.completions.create(model=SERVED, messages=HI, max_tokens=3, temperature=0, **kwargs)
        assert r.choices[0].message.content == plain.choices[0].message.content, kwargs
        assert r.choices[0].message.tool_calls is None


def test_completions_serve_values_that_ask_for_nothing(client):
    plain = client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, temperature=0).choices[0].text
    harmless = client.completions.create(model=SERVED, prompt="Hello", max_tokens=3, temperature=0, logit_bias={},
                                         extra_body={"response_format": {"type": "text"}})
    assert harmless.choices[0].text == plain

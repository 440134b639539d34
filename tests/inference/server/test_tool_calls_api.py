"""Forced tool calls through the official openai SDK against a real worker (SmolLM2, greedy):
a named function and tool_choice "required", streaming and not (the SDK's stream helper and
per-index accumulation reassemble the deltas), parallel calls, tool_choice "none", later turns
with tool results; "auto" and every malformed tool field are a 400 naming the parameter, and
the worker serves the next request as usual."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.inference.server.conftest import SERVED

WEATHER_PARAMS = {"type": "object",
                  "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "city": {"type": "string", "maxLength": 8}},
                  "required": ["unit", "city"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["utc", "cet"]}},
               "required": ["tz"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER_PARAMS, "strict": True}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                         "parameters": TIME_PARAMS, "strict": True}}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _check_call(call, name: str | None = None) -> dict:
    assert call.type == "function" and call.id.startswith("call_"), call
    assert call.function.name == name if name else call.function.name in PARAMS, call
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])
    return arguments


def _accumulate(chunks) -> tuple[dict[int, dict], list]:
    """Tool calls by index from raw stream chunks (what a client without the helper does), and
    the finish reasons; checks OpenAI's delta shape on the way."""
    calls: dict[int, dict] = {}
    finishes = []
    for chunk in chunks:
        [choice] = chunk.choices
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        assert choice.delta.content is None, chunk
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:  # the first delta of a call: id, type, name, no arguments yet
                assert delta.id.startswith("call_") and delta.type == "function", delta
                assert delta.function.name and delta.function.arguments == "", delta
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None, delta
                calls[delta.index]["arguments"] += delta.function.arguments
    return calls, finishes


def _served_after_refusal(client) -> None:
    r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_named_function_is_called_streaming_or_not(client):
    r = client.chat.completions.create(model=SERVED, messages=ASK, tools=[TIME, WEATHER], tool_choice=NAMED,
                                       max_tokens=24, temperature=0)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    arguments = _check_call(call, "get_weather")
    assert list(arguments) == ["unit", "city"]  # the schema's property order
    # The SDK's stream helper reassembles the deltas and parses the strict tool's arguments.
    with client.chat.completions.stream(model=SERVED, messages=ASK, tools=[TIME, WEATHER], tool_choice=NAMED,
                                        max_tokens=24, temperature=0) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert streamed.function.arguments == call.function.arguments and streamed.function.name == "get_weather"
    assert [e.parsed_arguments for e in done] == [arguments]


def test_required_calls_one_of_the_tools_streaming_or_not(client):
    kwargs = {"model": SERVED, "messages": ASK, "tools": [TIME, WEATHER], "tool_choice": "required",
              "max_tokens": 32, "temperature": 0}
    r = client.chat.completions.create(**kwargs)
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    [call] = choice.message.tool_calls
    _check_call(call)
    calls, finishes = _accumulate(client.chat.completions.create(**kwargs, stream=True))
    assert finishes == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]


def test_parallel_tool_calls_true_allows_an_array_of_calls(client):
    r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Time in UTC?"}],
                                       tools=[TIME], tool_choice="required", parallel_tool_calls=True,
                                       max_tokens=20, temperature=0)
    [choice] = r.choices
    assert choice.message.tool_calls, choice
    # Greedy SmolLM2 may go on calling until max_tokens: every call but a cut-off last is whole.
    whole = choice.message.tool_calls if choice.finish_reason == "tool_calls" else choice.message.tool_calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length") and whole, choice
    for call in whole:
        _check_call(call)
    assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


def test_tool_choice_none_answers_in_text_as_without_tools(client):
    plain = client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=3, temperature=0)
    r = client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER], tool_choice="none",
                                       max_tokens=3, temperature=0)
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_a_later_turn_carries_the_call_and_its_result(client):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit":"c","city":"Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = client.chat.completions.create(model=SERVED, messages=history, tools=[WEATHER], tool_choice="none",
                                       max_tokens=3, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    # The call is part of the prompt (written as text for SmolLM2's template), not dropped.
    shorter = client.chat.completions.create(model=SERVED, messages=[*ASK, {**history[2], "role": "user"}],
                                             max_tokens=1)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens + 10


def test_auto_is_refused_naming_tool_choice(client):
    for kwargs in ({"tool_choice": "auto"}, {}):  # tools alone default to "auto"
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model=SERVED, messages=ASK, tools=[WEATHER], max_tokens=1,
                                               stream=stream, **kwargs)
            body = e.value.body
            assert body["param"] == "tool_choice" and body["code"] == "unsupported_value", body
            assert '"auto"' in body["message"] and "not supported" in body["message"]
    _served_after_refusal(client)


def _function(**fields) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, **fields}}


BAD_TOOLS = [
    ({"tools": "f", "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"parameters": {"type": "object"}}}], "tool_choice": "required"},
     "tools[0].function.name"),
    ({"tools": [_function(name="get weather")], "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [_function(name="x" * 65)], "tool_choice": "required"}, "tools[0].function.name"),
    ({"tools": [WEATHER, _function(name="get_weather")], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [_function(parameters={"type": "array"})], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [_function(parameters=[])], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [_function(parameters={"type": "object", "properties": {"a": {"type": "strin"}}})],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, _function(parameters={"type": "object", "description": "x" * 70_000})],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[1].function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_TOOLS, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD_TOOLS)])
def test_a_malformed_tool_field_is_a_400_naming_it(client, fields, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=1, stream=stream,
                                           extra_body=fields)
        body = e.value.body
        assert body["param"] == param and body["message"].startswith(param), body
    _served_after_refusal(client)

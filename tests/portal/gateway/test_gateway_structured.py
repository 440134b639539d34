"""Structured output and tool calls through the gateway, with the official `openai` SDK against the
real SmolLM2 worker: the fields reach the worker untouched, a json_schema answer is JSON that
matches its schema, a forced tool call comes back whole (non-streaming) and as OpenAI tool-call
deltas the SDK reassembles (streaming, finish_reason "tool_calls"), a schema the worker refuses is
a 400 naming response_format that no other worker is asked, and every ledger row says how its
request was constrained (UsageRecord.constrained)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from portal.fleet.selectors import routing_key
from tests.portal.gateway.conftest import (
    BASE,
    chat_prefix_key,
    dead_worker_url,
    sdk,
    usage_rows,
    wait_for_row,
    wait_until,
)
from tests.portal.gateway.metrics_scrape import scrape

ASK = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
# Bounded strings: a greedy tiny model cannot ramble past max_tokens inside the JSON.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "capital", "schema": ANSWER_SCHEMA, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def retries(scraped, url: str) -> float:
    """How often the gateway moved on from the worker at `url`, whatever the reason."""
    return sum(value for (name, labels), value in scraped.samples.items()
               if name == "loraplex_gateway_upstream_retries_total" and ("worker", url) in labels)


def test_the_quota_estimate_counts_the_tool_definitions_the_prompt_will_carry():
    from portal.gateway.validation import CHAT, estimate_prompt_tokens

    plain = {"model": BASE, "messages": WEATHER_ASK}
    with_tools = {**plain, "tools": [WEATHER], "tool_choice": "required"}

    message_chars = len(WEATHER_ASK[0]["content"]) + 8  # its text and the role markers
    tools_chars = len(json.dumps([WEATHER], separators=(",", ":")))
    assert estimate_prompt_tokens(CHAT, plain) == message_chars // 4
    assert estimate_prompt_tokens(CHAT, with_tools) == (message_chars + tools_chars) // 4


def test_a_json_schema_answer_matches_its_schema_and_its_row_says_so(live, acme):
    answer = sdk(live, acme.key).chat.completions.with_raw_response.create(
        model=BASE, messages=ASK, max_tokens=48, temperature=0, response_format=RESPONSE_FORMAT)
    completion = answer.parse()

    assert completion.choices[0].finish_reason == "stop", completion
    jsonschema.validate(json.loads(completion.choices[0].message.content), ANSWER_SCHEMA)
    row = wait_for_row(answer.headers["x-request-id"])
    assert (row.constrained, row.status_code, row.finish_reason) == ("json_schema", 200, "stop")
    assert (row.prompt_tokens, row.completion_tokens) == (completion.usage.prompt_tokens,
                                                         completion.usage.completion_tokens)


def test_a_forced_tool_call_comes_back_whole(live, acme):
    answer = sdk(live, acme.key).chat.completions.with_raw_response.create(
        model=BASE, messages=WEATHER_ASK, max_tokens=48, temperature=0, tools=[WEATHER], tool_choice=CALL_WEATHER)
    completion = answer.parse()

    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", completion
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert completion.model == BASE
    row = wait_for_row(answer.headers["x-request-id"])
    assert (row.constrained, row.status_code, row.finish_reason, row.stream) == ("tools", 200, "tool_calls", False)
    assert row.completion_tokens == completion.usage.completion_tokens > 0


def test_a_streamed_tool_call_is_reassembled_by_the_sdk(live, acme):
    with sdk(live, acme.key).chat.completions.stream(
            model=BASE, messages=WEATHER_ASK, max_tokens=48, temperature=0, tools=[WEATHER], tool_choice="required",
            parallel_tool_calls=False, stream_options={"include_usage": True}) as stream:
        deltas = [event.chunk for event in stream if event.type == "chunk"]
        completion = stream.get_final_completion()

    assert any(c.choices and c.choices[0].delta.tool_calls for c in deltas)  # relayed as tool-call deltas
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls", completion
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    [row] = wait_until(lambda: usage_rows(tenant=acme.tenant))  # the SDK's stream helper hides the headers
    assert (row.constrained, row.status_code, row.finish_reason, row.stream) == ("tools", 200, "tool_calls", True)
    assert row.completion_tokens == completion.usage.completion_tokens > 0


def test_a_bad_schema_is_a_400_naming_response_format_asked_of_one_worker_only(live, acme, worker, settings):
    # A second worker after the real one (a dead port): a 400 must not move on to it.
    key = routing_key(None, chat_prefix_key(acme.tenant, ASK))
    second = dead_worker_url(key, worker.url, above=False)
    settings.INFERENCE_URLS = [worker.url, second]
    before = scrape(live.url)
    bad = {"type": "json_schema", "json_schema": {"name": "broken", "schema": {"type": "no-such-type"}}}

    with pytest.raises(openai.BadRequestError) as info:
        sdk(live, acme.key).chat.completions.create(model=BASE, messages=ASK, max_tokens=8, response_format=bad)

    error = info.value.body
    assert error["param"].startswith("response_format"), error
    assert error["type"] == "invalid_request_error" and error["message"]
    after = scrape(live.url)
    assert retries(after, worker.url) == retries(before, worker.url)  # not passed on to `second`
    row = wait_for_row(info.value.response.headers["x-request-id"])
    assert (row.status_code, row.constrained, row.worker_url) == (400, "json_schema", "")
    assert (row.prompt_tokens, row.completion_tokens) == (0, 0) and row.error == error["message"]


def test_the_fields_pass_the_gateway_as_sent(live, acme):
    """json_object on /v1/completions, and tool_choice "none" (plain text, no marker)."""
    headers = {"authorization": f"Bearer {acme.key}"}
    text = httpx.post(f"{live.url}/v1/completions", headers=headers, timeout=120, json={
        "model": BASE, "prompt": 'A JSON object with a key "a": ', "max_tokens": 32, "temperature": 0,
        "response_format": {"type": "json_object"}})
    plain = httpx.post(f"{live.url}/v1/chat/completions", headers=headers, timeout=120, json={
        "model": BASE, "messages": WEATHER_ASK, "max_tokens": 4, "tools": [WEATHER], "tool_choice": "none"})

    assert text.status_code == 200, text.text
    assert plain.status_code == 200, plain.text
    assert "tool_calls" not in plain.json()["choices"][0]["message"] or not plain.json()["choices"][0]["message"]["tool_calls"]
    assert wait_for_row(text.headers["x-request-id"]).constrained == "json_object"
    assert wait_for_row(plain.headers["x-request-id"]).constrained == ""

"""Structured output and logit_bias through the official openai SDK against a real worker
(SmolLM2, greedy): response_format json_object / json_schema on chat and completions, streaming
and not, outputs checked with `jsonschema` (and the SDK's own `parse` helper); bad values are a
400 naming the parameter, and the worker serves the next request as usual."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from inference.models.tokenizer import load_tokenizer
from tests.inference.server.conftest import SERVED

PARIS = [{"role": "user", "content": "Describe Paris as JSON."}]
# Nested object, array of enums, required fields; bounded so greedy SmolLM2 finishes in ~25 tokens.
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["big", "old"]}, "maxItems": 2},
        "pos": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "tags", "pos"],
    "additionalProperties": False,
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}


class Pos(BaseModel):
    x: int = Field(ge=0, le=9)


class City(BaseModel):
    name: str = Field(max_length=8)
    tags: list[Literal["big", "old"]] = Field(max_length=2)
    pos: Pos


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


def _served_after_refusal(client) -> None:
    r = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_json_object_is_one_json_object(client):
    r = client.chat.completions.create(model=SERVED, messages=PARIS, max_tokens=24, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_json_schema_output_is_valid_streaming_or_not(client):
    full = client.chat.completions.create(model=SERVED, messages=PARIS, max_tokens=40, temperature=0,
                                          response_format=CITY_FORMAT)
    [choice] = full.choices
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
    assert list(json.loads(choice.message.content)) == ["name", "tags", "pos"]  # the schema's order
    chunks = list(client.chat.completions.create(model=SERVED, messages=PARIS, max_tokens=40, temperature=0,
                                                 response_format=CITY_FORMAT, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def test_the_sdk_parse_helper_gets_its_pydantic_model(client):
    r = client.chat.completions.parse(model=SERVED, messages=PARIS, max_tokens=40, temperature=0,
                                      response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and 0 <= parsed.pos.x <= 9, r


def test_completions_take_response_format(client):
    prompt = "A city as JSON:"
    r = client.completions.create(model=SERVED, prompt=prompt, max_tokens=40, temperature=0,
                                  extra_body={"response_format": CITY_FORMAT})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].text), CITY_SCHEMA)
    streamed = client.completions.create(model=SERVED, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads("".join(c.choices[0].text for c in streamed)), dict)


def test_logit_bias_forces_and_bans_tokens(client, tokenizer):
    [banana] = tokenizer.encode(" banana")
    plain = client.completions.create(model=SERVED, prompt="Hello", max_tokens=2, temperature=0).choices[0].text
    forced = client.completions.create(model=SERVED, prompt="Hello", max_tokens=2, temperature=0,
                                       logit_bias={str(banana): 100}).choices[0].text
    assert forced == " banana banana" != plain
    first = tokenizer.encode(plain)[0]
    banned = client.completions.create(model=SERVED, prompt="Hello", max_tokens=2, temperature=0,
                                       logit_bias={str(first): -100}).choices[0].text
    assert tokenizer.encode(banned)[0] != first
    chat = client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(banana): 100})
    assert chat.choices[0].message.content == " banana banana"


BAD_FORMATS = [
    ("json", "response_format: expected"),
    ({"type": "xml"}, "response_format.type: unknown type 'xml'"),
    ({"type": "json_schema"}, "response_format.json_schema: expected"),
    ({"type": "json_schema", "json_schema": {"schema": CITY_SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": CITY_SCHEMA}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": CITY_SCHEMA, "strict": "yes"}},
     "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "strin"}}}, "response_format.json_schema:"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "description": "x" * 70_000}}},
     "the limit is 65536 bytes"),
]


@pytest.mark.parametrize(("value", "message"), BAD_FORMATS, ids=[m for _, m in BAD_FORMATS])
def test_a_bad_response_format_is_a_400_naming_it(client, value, message):
    for create, kwargs in ((client.chat.completions.create, {"messages": PARIS}),
                           (client.completions.create, {"prompt": "Hi"})):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                create(model=SERVED, max_tokens=1, stream=stream, extra_body={"response_format": value}, **kwargs)
            assert e.value.body["param"] == "response_format", e.value.body
            assert message in e.value.body["message"], e.value.body
    _served_after_refusal(client)


@pytest.mark.parametrize("bias", [{"abc": 1}, {"-1": 1}, {"49152": 1}, {"1.5": 1}, {"28": 101}, {"28": -100.5},
                                  {"28": True}, {"28": "1"}, [28], "28"])
def test_a_bad_logit_bias_is_a_400_naming_it(client, bias):
    for create, kwargs in ((client.chat.completions.create, {"messages": PARIS}),
                           (client.completions.create, {"prompt": "Hi"})):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=SERVED, max_tokens=1, extra_body={"logit_bias": bias}, **kwargs)
        assert e.value.body["param"] == "logit_bias", e.value.body
        assert e.value.body["message"].startswith("logit_bias"), e.value.body
    _served_after_refusal(client)

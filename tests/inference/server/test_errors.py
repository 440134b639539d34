"""Bad input gets OpenAI's error shape, a 4xx naming the parameter, never a 500; the SDK raises
its typed exceptions for them."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.inference.server.conftest import SERVED

HI = [{"role": "user", "content": "Hi"}]


def _post(server, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", timeout=60, **kwargs)


def _assert_error(r: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    assert error["message"]
    return error


def test_unknown_model_is_404_model_not_found(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    _assert_error(_post(server, "/v1/chat/completions", json={"model": "nope", "messages": HI}), 404, "model",
                  "model_not_found")


def test_prompt_over_the_context_is_400_context_length_exceeded(client):
    long = "hello " * 9000  # > 8192 tokens
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": long}], max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=SERVED, prompt=long, max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"


@pytest.mark.parametrize(("field", "value", "param"), [
    ("temperature", "hot", "temperature"),
    ("temperature", 2.5, "temperature"),
    ("top_p", 0, "top_p"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", "5", "max_tokens"),
    ("max_completion_tokens", -1, "max_completion_tokens"),
    ("n", 0, "n"),
    ("seed", 1.5, "seed"),
    ("stop", [1, 2], "stop"),
    ("stream", "yes", "stream"),
    ("presence_penalty", 3, "presence_penalty"),
    ("top_logprobs", 21, "top_logprobs"),
    ("logprobs", 1, "logprobs"),
    ("messages", [], "messages"),
    ("messages", [{"content": "no role"}], "messages[0].role"),
    ("messages", [{"role": "robot", "content": "hi"}], "messages[0].role"),
    ("tenant_weight", 0, "tenant_weight"),
    ("stream_options", {"include_usage": "yes"}, "stream_options.include_usage"),
])
def test_bad_chat_values_are_400_naming_the_param(server, field, value, param):
    body = {"model": SERVED, "messages": HI, "max_tokens": 2, field: value}
    error = _assert_error(_post(server, "/v1/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "stop": ["", "a"]}, "stop[0]"),
    ({}, "prompt"),
])
def test_bad_completion_values_are_400_naming_the_param(server, body, param):
    _assert_error(_post(server, "/v1/completions", json={"model": SERVED, "max_tokens": 1, **body}), 400, param)


def test_top_logprobs_without_logprobs_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=SERVED, messages=HI, max_tokens=1, top_logprobs=2)
    assert e.value.param == "top_logprobs"


@pytest.mark.parametrize("raw", [b"{bad json", b"[1, 2]", b'"text"', b"", b"\xff\xfe"])
def test_malformed_bodies_are_400(server, raw):
    r = _post(server, "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    _assert_error(r, 400, None)


def test_unknown_route_and_method_keep_the_error_shape(server):
    assert httpx.get(f"{server.url}/v1/nothing").json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()

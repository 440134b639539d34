"""The wire's shared definitions (protocol.worker_api), without either side: the load body's
rules and its JSON, the error object as written and as read back, the base-model description,
the routes and the unsupported-parameter rule."""

from __future__ import annotations

import json

import pytest

from protocol import worker_api
from protocol.worker_api import (
    BaseModelInfo,
    BodyError,
    ErrorObject,
    LoadAdapterBody,
    UnloadAdapterBody,
)

SHA = {"adapter_config.json": "a" * 64, "adapter_model.safetensors": "b" * 64}
# What a worker's GET /v1/base_model answers (inference/server/app.py).
WORKER_BASE = {
    "name": "smollm2", "checkpoint_name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "num_hidden_layers": 30,
    "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "vocab_size": 49152, "max_model_len": 8192, "dtype": "bfloat16", "max_loras": 4,
    "max_cpu_loras": 16, "max_lora_rank": 16,
}


# -- the load body ---------------------------------------------------------------------------------


def test_a_local_load_is_vllms_body():
    body = LoadAdapterBody.local(lora_name="lora-1", lora_path="/srv/adapters/a")
    assert body.to_json() == {"lora_name": "lora-1", "lora_path": "/srv/adapters/a"}
    assert LoadAdapterBody.local(lora_name="lora-1", lora_path="/a", pin=True).to_json()["pin"] is True


def test_a_fetched_load_names_the_url_the_digests_and_the_token():
    body = LoadAdapterBody.fetched(lora_name="lora-1", lora_url="http://portal/internal/adapters/u/", files=SHA,
                                   auth_token="t0ken")
    assert body.to_json() == {"lora_name": "lora-1", "lora_url": "http://portal/internal/adapters/u/",
                              "files": SHA, "auth_token": "t0ken"}
    assert "auth_token" not in LoadAdapterBody.fetched(lora_name="x", lora_url="http://p/", files=SHA).to_json()
    # The body is JSON as it is, and its files are a copy (the caller's dict may change).
    files = dict(SHA)
    body = LoadAdapterBody.fetched(lora_name="x", lora_url="http://p/", files=files)
    files.clear()
    assert json.loads(json.dumps(body.to_json()))["files"] == SHA


@pytest.mark.parametrize(
    ("fields", "param", "needle"),
    [
        ({}, "lora_path", "exactly one of"),
        ({"lora_path": "/a", "lora_url": "http://p/", "files": SHA}, "lora_path", "exactly one of"),
        ({"lora_url": "http://p/"}, "files", "lora_url needs files"),
        ({"lora_path": ""}, "lora_path", "non-empty"),
        ({"lora_url": "http://p/" + "x" * worker_api.LORA_URL_MAX, "files": SHA}, "lora_url", "characters"),
    ],
)
def test_a_load_body_breaking_a_rule_names_the_field(fields, param, needle):
    with pytest.raises(BodyError) as info:
        LoadAdapterBody(lora_name="lora-1", **fields)
    assert info.value.param == param and needle in info.value.message


@pytest.mark.parametrize("name", ["", "x" * (worker_api.LORA_NAME_MAX + 1), None, 7])
def test_adapter_names_are_1_to_256_characters(name):
    with pytest.raises(BodyError) as info:
        LoadAdapterBody(lora_name=name, lora_path="/a")
    assert info.value.param == "lora_name"
    with pytest.raises(BodyError):
        UnloadAdapterBody(name)
    assert UnloadAdapterBody("x" * worker_api.LORA_NAME_MAX).to_json() == {"lora_name": "x" * 256}


def test_the_field_lists_are_the_bodies_fields():
    assert worker_api.LOAD_ADAPTER_FIELDS == ("lora_name", "lora_path", "lora_url", "files", "auth_token", "pin")
    assert worker_api.UNLOAD_ADAPTER_FIELDS == ("lora_name",)


def test_pin_routes_fill_the_template_with_one_escaped_segment():
    assert worker_api.pin_path("lora-ab12", pinned=True) == "/v1/adapters/lora-ab12/pin"
    assert worker_api.pin_path("lora-ab12", pinned=False) == "/v1/adapters/lora-ab12/unpin"
    assert worker_api.pin_path("a/b c", pinned=True) == "/v1/adapters/a%2Fb%20c/pin"
    assert worker_api.PIN_ADAPTER.format(name="{name}") == worker_api.PIN_ADAPTER  # a route template


# -- the error object ------------------------------------------------------------------------------


def test_an_error_object_is_openais_shape_and_reads_back():
    error = ErrorObject("adapter 'x' is not registered", param="lora_name", code=worker_api.ADAPTER_NOT_FOUND)
    body = error.to_json()
    assert body == {"error": {"message": "adapter 'x' is not registered", "type": "invalid_request_error",
                              "param": "lora_name", "code": "adapter_not_found"}}
    assert ErrorObject.parse(json.dumps(body).encode()) == error
    assert ErrorObject.parse(json.dumps(body)) == error


@pytest.mark.parametrize(
    "raw",
    [b"", b"<html>502 Bad Gateway</html>", b"[1, 2]", b'{"status": "loading"}', b'{"error": "plain text"}',
     b'{"status": "dead", "error": "CUDA error"}', b"\xff\xfe", b'{"error": null}'],
)
def test_a_body_that_is_not_an_error_object_parses_to_none(raw):
    assert ErrorObject.parse(raw) is None


def test_an_error_objects_fields_of_the_wrong_type_are_dropped():
    raw = json.dumps({"error": {"message": 42, "type": ["x"], "param": 3, "code": {"a": 1}, "extra": True}})
    assert ErrorObject.parse(raw) == ErrorObject(message="42", type="", param=None, code=None)
    assert ErrorObject.parse(b'{"error": {}}') == ErrorObject(message="", type="", param=None, code=None)


def test_the_load_errors_the_portal_blames_on_the_worker():
    assert worker_api.WORKER_SIDE_LOAD_ERRORS == {"adapter_fetch_failed", "adapter_source_forbidden"}
    assert worker_api.ADAPTER_INVALID not in worker_api.WORKER_SIDE_LOAD_ERRORS


# -- the base model --------------------------------------------------------------------------------


def test_the_workers_base_model_description_reads_back_whole():
    info = BaseModelInfo.from_json(WORKER_BASE)
    assert info is not None and info.hidden_size == 576 and info.max_cpu_loras == 16
    assert info.to_json() == WORKER_BASE


def test_a_description_with_only_the_shapes_is_enough():
    shapes = {k: WORKER_BASE[k] for k in ("name", "num_hidden_layers", "hidden_size", "intermediate_size",
                                         "num_attention_heads")}
    info = BaseModelInfo.from_json({**shapes, "unknown_field": 1, "max_lora_rank": None})
    assert info is not None and info.to_json() == shapes and info.max_lora_rank is None


@pytest.mark.parametrize(
    "change",
    [{"hidden_size": None}, {"name": ""}, {"name": 5}, {"hidden_size": 0}, {"num_hidden_layers": "30"},
     {"num_attention_heads": True}, {"max_loras": -1}, {"max_lora_rank": 16.0}, {"dtype": 16}],
)
def test_a_description_missing_or_mistyping_a_field_is_none(change):
    assert BaseModelInfo.from_json({**WORKER_BASE, **change}) is None


@pytest.mark.parametrize("value", [None, [], "smollm2", 3])
def test_a_description_that_is_not_an_object_is_none(value):
    assert BaseModelInfo.from_json(value) is None


# -- completions -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "harmless"),
    [("functions", None, True), ("functions", [], True), ("functions", [{"name": "f"}], False),
     ("function_call", "none", True), ("function_call", {"name": "f"}, False),
     ("modalities", ["text"], True), ("modalities", ["text", "audio"], False), ("modalities", "text", False),
     ("audio", {"voice": "alloy"}, False), ("prediction", None, True)],
)
def test_an_unsupported_parameter_passes_only_when_it_asks_for_nothing(field, value, harmless):
    assert field in worker_api.UNSUPPORTED_CHAT_FIELDS
    assert worker_api.is_harmless(field, value) is harmless


def test_the_completions_route_refuses_a_subset_of_the_chat_routes_fields():
    assert set(worker_api.UNSUPPORTED_COMPLETION_FIELDS) <= set(worker_api.UNSUPPORTED_CHAT_FIELDS)

"""The worker's schemas for the bodies the portal sends agree with the shared definitions
(protocol.worker_api): the same fields, the same limits, the same rules, and a drifted schema
cannot even be imported. No server: pydantic and the shared dataclasses only."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from inference.server.errors import APIError
from inference.server.protocol import (
    LoadLoraAdapterRequest,
    UnloadAdapterRequest,
    require_shared_fields,
)
from protocol import worker_api
from protocol.worker_api import BodyError, ErrorObject, LoadAdapterBody

SHA = {"adapter_config.json": "0" * 64, "adapter_model.safetensors": "1" * 64}


def test_the_schemas_have_the_shared_bodies_fields():
    assert tuple(LoadLoraAdapterRequest.model_fields) == worker_api.LOAD_ADAPTER_FIELDS
    assert tuple(UnloadAdapterRequest.model_fields) == worker_api.UNLOAD_ADAPTER_FIELDS


def test_a_schema_that_drifts_from_the_shared_body_is_refused():
    class Drifted(BaseModel):
        lora_name: str
        lora_dir: str | None = None

    with pytest.raises(TypeError, match="protocol.worker_api defines"):
        require_shared_fields(Drifted, worker_api.UNLOAD_ADAPTER_FIELDS)
    require_shared_fields(UnloadAdapterRequest, worker_api.UNLOAD_ADAPTER_FIELDS)


@pytest.mark.parametrize(
    "body",
    [
        LoadAdapterBody.local(lora_name="lora-a", lora_path="/srv/a"),
        LoadAdapterBody.local(lora_name="lora-a", lora_path="/srv/a", pin=True),
        LoadAdapterBody.fetched(lora_name="lora-b", lora_url="http://portal:8000/internal/adapters/u/", files=SHA,
                                auth_token="token"),
    ],
)
def test_what_the_portal_builds_the_worker_reads_back_unchanged(body):
    assert LoadLoraAdapterRequest.model_validate(body.to_json()).to_protocol() == body


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"lora_name": ""}, "lora_name"),
        ({"lora_name": "x" * (worker_api.LORA_NAME_MAX + 1)}, "lora_name"),
        ({"lora_url": "http://p/" + "x" * worker_api.LORA_URL_MAX, "files": SHA, "lora_path": None}, "lora_url"),
        ({"lora_path": ""}, "lora_path"),
    ],
)
def test_both_sides_refuse_a_field_out_of_bounds(fields, param):
    body = {"lora_name": "lora-a", "lora_path": "/srv/a", **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(ValidationError) as info:
        LoadLoraAdapterRequest.model_validate(body)
    assert info.value.errors()[0]["loc"] == (param,)
    with pytest.raises(BodyError) as shared:
        LoadAdapterBody(**body)
    assert shared.value.param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [({"lora_name": "a"}, "lora_path"), ({"lora_name": "a", "lora_path": "/a", "lora_url": "http://p/"}, "lora_path"),
     ({"lora_name": "a", "lora_url": "http://p/"}, "files")],
)
def test_the_rules_types_cannot_say_come_from_the_shared_body(body, param):
    request = LoadLoraAdapterRequest.model_validate(body)  # well-typed...
    with pytest.raises(BodyError) as info:
        request.to_protocol()  # ...but one source, with its files, is the shared rule
    assert info.value.param == param


def test_the_workers_errors_are_the_shared_error_object():
    error = APIError(404, "adapter 'x' is not registered", param="lora_name", code=worker_api.ADAPTER_NOT_FOUND)
    assert ErrorObject.from_json(error.body()) == ErrorObject("adapter 'x' is not registered", param="lora_name",
                                                              code="adapter_not_found")

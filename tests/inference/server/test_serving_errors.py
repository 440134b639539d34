"""How an engine request that finished with an error becomes the client's 400: a failed output
constraint names response_format (not the model), an adapter that failed to load names model."""

from __future__ import annotations

import dataclasses

import pytest

from inference.engine.outputs import RequestOutput, Usage
from inference.server.errors import APIError
from inference.server.serving import raise_if_error


def _failed(error: str | None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1], token_ids=[], text="", delta_text="",
                         delta_token_ids=[], finished=True, finish_reason="error", usage=Usage(1, 0), error=error)


@pytest.mark.parametrize(
    ("error", "param", "code"),
    [
        ("response_format.json_schema: Invalid type: strin", "response_format", "structured_output_failed"),
        ("structured output: parser limit reached", None, "structured_output_failed"),
        ("adapter 'a' failed to load: bad rank", "model", "adapter_load_failed"),
        (None, "model", "adapter_load_failed"),
    ],
)
def test_an_engine_error_becomes_a_400_naming_its_cause(error, param, code):
    with pytest.raises(APIError) as raised:
        raise_if_error(_failed(error))
    assert (raised.value.status, raised.value.param, raised.value.code) == (400, param, code)
    assert raised.value.message == (error or "the request failed")


def test_a_finished_request_without_an_error_passes():
    raise_if_error(dataclasses.replace(_failed(None), finish_reason="stop"))

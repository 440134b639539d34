import dataclasses
import re

import pytest

from inference.engine.sampling_params import SamplingParams, SamplingType


def test_defaults_are_valid_and_random():
    params = SamplingParams()
    assert params.max_tokens == 16
    assert params.top_k == 0
    assert params.stop == () and params.stop_token_ids == ()
    assert params.sampling_type is SamplingType.RANDOM


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"temperature": 0}, SamplingType.GREEDY),
        ({"temperature": 1e-6}, SamplingType.GREEDY),  # below the greedy cut-off
        ({"temperature": 0, "seed": 3}, SamplingType.GREEDY),  # greedy ignores the seed
        ({"temperature": 0.7}, SamplingType.RANDOM),
        ({"temperature": 0.7, "seed": 0}, SamplingType.RANDOM_SEEDED),
    ],
)
def test_sampling_type(kwargs, expected):
    assert SamplingParams(**kwargs).sampling_type is expected


def test_normalisation():
    params = SamplingParams(
        temperature=1, top_k=-1, stop="###", stop_token_ids=[7, 9], max_tokens=None, logprobs=0
    )
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.top_k == 0  # -1 means disabled, like vLLM
    assert params.stop == ("###",)
    assert params.stop_token_ids == (7, 9)
    assert params.max_tokens is None
    assert params.logprobs == 0
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")


def test_edge_values_are_accepted():
    SamplingParams(top_p=1.0, min_p=0.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(top_p=1e-9, min_p=1.0, presence_penalty=2, frequency_penalty=-2)
    SamplingParams(seed=0, logprobs=20, top_k=1, repetition_penalty=1e-3, temperature=5.0)
    SamplingParams(seed=-(2**63))
    SamplingParams(seed=2**64 - 1)


def test_frozen_and_replace_revalidates():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    assert dataclasses.replace(params, top_k=-1).top_k == 0
    with pytest.raises(ValueError, match="^max_tokens"):
        dataclasses.replace(params, max_tokens=-1)
    assert dataclasses.replace(params, max_tokens=0).max_tokens == 0  # prefill only (prompt scoring)


INVALID = [
    ("max_tokens", -1),
    ("max_tokens", -3),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", float("nan")),
    ("top_k", -2),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("presence_penalty", 2.1),
    ("presence_penalty", -2.1),
    ("frequency_penalty", 3),
    ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("seed", 1.0),
    ("seed", "1"),
    ("seed", True),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 1]),
    ("stop", 5),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["a"]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", "abc"),
    ("stop_token_ids", 3),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("prompt_logprobs", True),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("include_stop_str_in_output", None),
    ("structured_output", {"type": "json_object"}),
    ("logit_bias", {1: 101}),
    ("logit_bias", {-1: 1}),
    ("logit_bias", [1, 2]),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{re.escape(field)}\b"):
        SamplingParams(**{field: value})


def test_every_field_has_an_invalid_case():
    tested = {field for field, _ in INVALID}
    assert tested == {f.name for f in dataclasses.fields(SamplingParams)}

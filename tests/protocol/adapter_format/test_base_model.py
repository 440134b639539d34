"""base_model_name_or_path against the served base's name: another model refused, the same one
accepted, a name that cannot be compared accepted with a warning (or refused when strict)."""

from __future__ import annotations

import pytest

from protocol.adapter_format.base_model import ModelName, check_base_name, parse_model_name

SERVED = "Smollm2 135M 8k Lc100K Mix1 Ep2"  # the default GGUF's general.name


@pytest.mark.parametrize(
    "claimed",
    [
        "HuggingFaceTB/SmolLM2-1.7B-Instruct",
        "meta-llama/Llama-3.1-8B",
        "HuggingFaceTB/SmolLM2-360M",
        "Qwen/Qwen2.5-135M",
        "/models/SmolLM2-1.7B",
    ],
)
def test_a_name_of_another_model_is_refused(claimed: str) -> None:
    assert check_base_name(claimed, SERVED) == (
        [f"base_model_name_or_path {claimed!r} names a different model than the served base {SERVED!r}"],
        None,
    )


@pytest.mark.parametrize("claimed", ["HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M", "smollm2-135m"])
@pytest.mark.parametrize("strict", [False, True])
def test_a_name_of_the_served_model_is_accepted(claimed: str, strict: bool) -> None:
    assert check_base_name(claimed, SERVED, strict=strict) == ([], None)


@pytest.mark.parametrize(
    ("claimed", "why"),
    [
        ("/home/me/checkpoints/base", "'/home/me/checkpoints/base' is not a recognisable model id"),
        ("my-favourite-model", "'my-favourite-model' is not a recognisable model id"),
        (None, "is missing"),
        ("", "is missing"),
    ],
)
def test_a_name_that_cannot_be_compared_warns_or_is_refused_when_strict(claimed, why: str) -> None:
    assert check_base_name(claimed, SERVED) == (
        [],
        f"base_model_name_or_path {why}; accepted because every tensor shape matches the served base {SERVED!r}",
    )
    assert check_base_name(claimed, SERVED, strict=True) == (
        [f"base_model_name_or_path {why}; strict_base_match requires it to name the served base {SERVED!r}"],
        None,
    )


def test_a_served_base_with_an_unrecognisable_name() -> None:
    reasons, warning = check_base_name("meta-llama/Llama-3.1-8B", "tiny-checkpoint")
    assert reasons == [] and warning == (
        "base_model_name_or_path 'meta-llama/Llama-3.1-8B' cannot be compared with the served base, whose name "
        "is not recognisable; accepted because every tensor shape matches the served base 'tiny-checkpoint'"
    )
    assert "strict_base_match requires" in check_base_name("meta-llama/Llama-3.1-8B", "tiny-checkpoint", strict=True)[0][0]


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ModelName("smollm2", 135e6)),
        ("Smollm2 135M 8k Lc100K Mix1 Ep2", ModelName("smollm2", 135e6)),
        ("meta-llama/Llama-3.1-8B", ModelName("llama31", 8e9)),
        ("mistralai/Mixtral-8x7B-v0.1", ModelName("mixtral", 56e9)),
        ("Qwen/Qwen2.5-0.5B-Instruct", ModelName("qwen25", 0.5e9)),
        ("C:\\models\\Llama-3.1-8B\\", ModelName("llama31", 8e9)),
        ("/home/me/ckpt", None),
        ("135M", None),
        ("", None),
    ],
)
def test_parse_model_name(name: str, parsed) -> None:
    assert parse_model_name(name) == parsed


def test_families_are_compared_leniently_sizes_within_one_percent() -> None:
    assert ModelName("llama31", 8e9).same_model(ModelName("metallama31", 8.03e9))
    assert not ModelName("llama31", 8e9).same_model(ModelName("llama31", 7e9))
    assert not ModelName("qwen25", 135e6).same_model(ModelName("smollm2", 135e6))

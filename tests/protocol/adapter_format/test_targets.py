"""target_modules / exclude_modules / layers_to_transform / layers_pattern / rank_pattern /
alpha_pattern resolved against a base with PEFT's semantics (test_adapter.py in
tests/inference/lora checks the same choices against PEFT's own wrapped modules)."""

from __future__ import annotations

import pytest

from protocol.adapter_format.settings import parse_settings
from protocol.adapter_format.targets import hf_module_names, resolve_targets
from tests.protocol.adapter_format.peft_files import TINY, lora_config

SUPPORTED = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"


def resolve(**changes):
    settings, reasons = parse_settings(lora_config(**changes), max_lora_rank=8)
    assert reasons == [], reasons
    return resolve_targets(settings, TINY)


def targets(**changes) -> dict:
    found, reasons = resolve(**changes)
    assert reasons == [], reasons
    return found


def refused(**changes) -> list[str]:
    found, reasons = resolve(**changes)
    assert found is None and reasons
    return reasons


def test_names_match_a_whole_name_or_its_last_segments() -> None:
    assert targets(target_modules=["q_proj", "v_proj"]) == {
        (layer, m): (4, 8.0) for layer in (0, 1) for m in ("q_proj", "v_proj")
    }
    assert set(targets(target_modules=["self_attn.o_proj", "model.layers.1.mlp.up_proj"])) == {
        (0, "o_proj"), (1, "o_proj"), (1, "up_proj"),
    }


def test_a_regex_full_matches_the_module_name() -> None:
    assert set(targets(target_modules=r".*\.1\.mlp\.(gate|down)_proj")) == {(1, "gate_proj"), (1, "down_proj")}


def test_all_linear() -> None:
    assert len(targets(target_modules="all-linear")) == 2 * 7


@pytest.mark.parametrize(
    ("excluded", "left"),
    [
        (["layers.1.self_attn.v_proj"], {(0, "q_proj"), (1, "q_proj"), (0, "v_proj")}),
        (r"model\.layers\.0\..*", {(1, "q_proj"), (1, "v_proj")}),
    ],
)
def test_exclusions_come_first(excluded, left) -> None:
    assert set(targets(exclude_modules=excluded)) == left


@pytest.mark.parametrize(
    ("changes", "layers"),
    [
        ({"layers_to_transform": 1}, {1}),
        ({"layers_to_transform": [0], "layers_pattern": "layers"}, {0}),
        ({"layers_to_transform": [1], "layers_pattern": ["blocks", "layers"]}, {1}),
        ({"layers_to_transform": [1], "layers_pattern": "blocks"}, set()),  # no such container: nothing selected
    ],
)
def test_layers_to_transform_picks_layers_by_pefts_index_match(changes, layers) -> None:
    found, reasons = resolve(**changes)
    if layers:
        assert {layer for layer, _ in found} == layers
    else:
        assert reasons == ["target_modules selects no projection of the base model"]


def test_a_full_name_entry_ignores_layers_to_transform_as_peft_does() -> None:
    assert set(targets(target_modules=["model.layers.0.self_attn.q_proj"], layers_to_transform=[1])) == {(0, "q_proj")}


def test_rank_and_alpha_patterns_per_projection() -> None:
    found = targets(target_modules="all-linear", rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
                    alpha_pattern={"v_proj": 32})
    assert found[(0, "q_proj")] == (2, 8.0) and found[(1, "down_proj")] == (6, 8.0)
    assert found[(0, "down_proj")] == (4, 8.0) and found[(1, "v_proj")] == (4, 32.0)


@pytest.mark.parametrize(
    ("target_modules", "reason"),
    [
        (["q_proj", "embed_tokens"], "target_modules 'embed_tokens' selects model.embed_tokens"),
        (["lm_head", "v_proj"], "target_modules 'lm_head' selects lm_head"),
        (["mlp"], "target_modules 'mlp' selects model.layers.0.mlp"),
        (r".*(q_proj|lm_head)", r"target_modules '.*(q_proj|lm_head)' selects lm_head"),
    ],
)
def test_a_module_that_is_not_a_projection(target_modules, reason: str) -> None:
    assert refused(target_modules=target_modules) == [
        f"{reason}, which is not a supported target module (supported: {SUPPORTED})"
    ]


def test_a_regex_selecting_containers_names_each_one() -> None:
    reasons = refused(target_modules=r"model\.layers\.\d+")
    assert reasons == [
        f"target_modules 'model\\\\.layers\\\\.\\\\d+' selects model.layers.{i}, which is not a supported target "
        f"module (supported: {SUPPORTED})"
        for i in (0, 1)
    ]


def test_an_entry_matching_nothing() -> None:
    assert refused(target_modules=["q_proj", "c_attn"]) == [
        f"target_modules entry 'c_attn' matches no module of the base model (supported: {SUPPORTED})"
    ]


def test_an_entry_excluded_entirely_matches_nothing() -> None:
    assert refused(target_modules=["q_proj", "v_proj"], exclude_modules=["v_proj"])[0].startswith(
        "target_modules entry 'v_proj' matches no module"
    )


def test_layers_to_transform_beyond_the_base() -> None:
    assert refused(layers_to_transform=[0, 5]) == ["layers_to_transform names layer 5; the base model has 2 layers"]


def test_a_regex_selecting_nothing() -> None:
    assert refused(target_modules=r".*\.c_attn") == ["target_modules selects no projection of the base model"]


def test_the_module_names_are_hf_llamas() -> None:
    names = [n for n, _, _ in hf_module_names(1)]
    assert names[:5] == ["model", "model.embed_tokens", "model.layers", "model.norm", "model.rotary_emb"]
    assert "model.layers.0.self_attn.k_proj" in names and "model.layers.0.post_attention_layernorm" in names
    assert names[-1] == "lm_head"
    projections = [(layer, m) for _, layer, m in hf_module_names(2) if m is not None]
    assert len(projections) == 14 and projections[0] == (0, "q_proj") and projections[-1] == (1, "down_proj")


def test_settings_resolved_again_give_an_answer_of_their_own() -> None:
    """Equal settings are resolved once (adapters of one recipe share them), yet what one caller
    does to its answer never reaches the next caller's."""
    first = targets(target_modules=["q_proj"], rank_pattern={"model.layers.1.self_attn.q_proj": 2})
    first[(0, "q_proj")] = (99, 1.0)
    first.clear()
    assert targets(target_modules=["q_proj"], rank_pattern={"model.layers.1.self_attn.q_proj": 2}) == {
        (0, "q_proj"): (4, 8.0), (1, "q_proj"): (2, 8.0),
    }
    reasons = refused(target_modules=["embed_tokens"])
    reasons.clear()
    assert refused(target_modules=["embed_tokens"]) != []

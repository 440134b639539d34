"""BaseShapes: the served base as the rules see it, built from a worker's base-model description."""

from __future__ import annotations

import pytest

from protocol.adapter_format.shapes import BaseShapes, module_path

SMOLLM2 = {"name": "SmolLM2-135M-Instruct", "checkpoint_name": "Smollm2 135M 8k Lc100K Mix1 Ep2",
           "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "max_lora_rank": 32}  # fmt: skip


def test_from_a_workers_base_model_description() -> None:
    shapes = BaseShapes.from_config(SMOLLM2)
    assert shapes.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"  # the checkpoint's own name is what adapters record
    assert (shapes.num_hidden_layers, shapes.max_lora_rank) == (30, 32)
    assert shapes.module_shapes() == {
        "q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
        "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576),
    }  # fmt: skip


def test_hf_config_defaults_when_a_description_leaves_them_out() -> None:
    config = {k: v for k, v in SMOLLM2.items() if k not in ("num_key_value_heads", "head_dim", "max_lora_rank",
                                                            "checkpoint_name")}
    shapes = BaseShapes.from_config(config, default_max_rank=8)
    assert (shapes.name, shapes.num_key_value_heads, shapes.head_dim, shapes.max_lora_rank) == (
        "SmolLM2-135M-Instruct", 9, 64, 8,
    )


@pytest.mark.parametrize(
    "config",
    [None, [], {"hidden_size": 5}, {**SMOLLM2, "hidden_size": "wide"}, {**SMOLLM2, "num_attention_heads": 0, "head_dim": None}],
)
def test_an_incomplete_description_gives_none(config) -> None:
    assert BaseShapes.from_config(config) is None


def test_module_path() -> None:
    assert module_path(3, "down_proj") == "model.layers.3.mlp.down_proj"
    assert module_path(0, "k_proj") == "model.layers.0.self_attn.k_proj"

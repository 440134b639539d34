"""adapter_config.json -> LoRASettings: PEFT's defaults, every field a plain LoRA may set, and
every reason a config is refused, all of them at once."""

from __future__ import annotations

import json
import math

import pytest

from protocol.adapter_format.settings import MAX_CONFIG_BYTES, parse_settings, read_config
from tests.protocol.adapter_format.peft_files import lora_config


def parsed(**changes):
    settings, reasons = parse_settings(lora_config(**changes), max_lora_rank=8)
    assert reasons == [] and settings is not None, reasons
    return settings


def refused(config: dict) -> list[str]:
    settings, reasons = parse_settings(config, max_lora_rank=8)
    assert settings is None and reasons
    return reasons


# --- read_config ---------------------------------------------------------------------------------


def test_a_config_is_read_as_a_json_object(tmp_path) -> None:
    (tmp_path / "c.json").write_text(json.dumps(lora_config()))
    assert read_config(tmp_path / "c.json") == (lora_config(), [])


@pytest.mark.parametrize("text", ['{"peft_type": "LORA", "r": 4', "", "not json"])
def test_malformed_json(tmp_path, text: str) -> None:
    (tmp_path / "c.json").write_text(text)
    config, [reason] = read_config(tmp_path / "c.json")
    assert config is None and reason.startswith("adapter_config.json is not valid JSON: ")


def test_a_config_that_is_not_an_object(tmp_path) -> None:
    (tmp_path / "c.json").write_text("[1, 2]")
    assert read_config(tmp_path / "c.json") == (None, ["adapter_config.json must hold a JSON object, got list"])


def test_a_config_too_large_is_not_read(tmp_path) -> None:
    (tmp_path / "c.json").write_text(" " * (MAX_CONFIG_BYTES + 1))
    assert read_config(tmp_path / "c.json") == (None, [f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes"])


def test_a_config_that_is_not_utf8(tmp_path) -> None:
    (tmp_path / "c.json").write_bytes(b'{"r": "\xff"}')
    config, [reason] = read_config(tmp_path / "c.json")
    assert config is None and reason.startswith("cannot read adapter_config.json: 'utf-8' codec can't decode")


def test_deeply_nested_json_is_a_reason_not_a_crash(tmp_path) -> None:
    (tmp_path / "c.json").write_text("[" * 100_000 + "]" * 100_000)
    config, [reason] = read_config(tmp_path / "c.json")
    assert config is None and reason.startswith("adapter_config.json is not valid JSON: ")


# --- what a plain LoRA may say -------------------------------------------------------------------


def test_pefts_defaults_when_the_config_leaves_fields_out() -> None:
    settings, reasons = parse_settings({"peft_type": "LORA"}, max_lora_rank=8)
    assert reasons == []
    assert (settings.r, settings.lora_alpha, settings.use_rslora) == (8, 8.0, False)
    assert settings.target_modules == ("q_proj", "v_proj")
    assert settings.layers_to_transform is None and settings.base_model_name_or_path is None


def test_all_linear_is_every_projection() -> None:
    assert parsed(target_modules="all-linear").target_modules == (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    )


def test_a_string_target_is_a_regex_matched_on_the_full_name() -> None:
    pattern = parsed(target_modules=r".*\.(q|v)_proj").target_modules
    assert pattern.fullmatch("model.layers.0.self_attn.q_proj") and not pattern.fullmatch("q_proj_x")


@pytest.mark.parametrize(("given", "layers"), [(1, frozenset({1})), ([0, 1], frozenset({0, 1})), ([], None), (None, None)])
def test_layers_to_transform_an_index_or_a_list(given, layers) -> None:
    assert parsed(layers_to_transform=given).layers_to_transform == layers  # [] means every layer in PEFT


def test_rank_and_alpha_patterns_first_match_wins_in_file_order() -> None:
    settings = parsed(rank_pattern={"q_proj": 2, "layers.1.self_attn.q_proj": 6}, alpha_pattern={"v_proj": 32})
    assert settings.rank_and_alpha("model.layers.1.self_attn.q_proj") == (2, 8.0)
    assert settings.rank_and_alpha("model.layers.0.self_attn.v_proj") == (4, 32.0)
    assert settings.rank_and_alpha("model.layers.0.mlp.xq_proj") == (4, 8.0)  # a key matches whole segments


def test_scale_is_alpha_over_r_or_over_its_root_with_rslora() -> None:
    assert parsed().scale(4, 8.0) == 2.0
    assert parsed(use_rslora=True).scale(4, 8.0) == 4.0
    assert parsed(use_rslora=True).scale(8, 8.0) == pytest.approx(8 / math.sqrt(8))


def test_training_only_fields_are_fine() -> None:
    parsed(lora_dropout=0.1, init_lora_weights="gaussian", use_rslora=True, fan_in_fan_out=False, revision="main")


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type 'PREFIX_TUNING' is not supported; only LORA adapters are"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported; only LORA adapters are"),
        ({"peft_type": None}, "adapter_config.json has no peft_type; only LORA adapters are supported"),
        ({"use_dora": True}, "use_dora is true; DoRA adapters are not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save ['lm_head'] is not supported (it replaces whole base modules)"),
        ({"bias": "all"}, "bias 'all' is not supported; only 'none' is"),
        ({"bias": "lora_only"}, "bias 'lora_only' is not supported; only 'none' is"),
        ({"r": 16}, "r = 16 is above max_lora_rank = 8"),
        ({"r": 0}, "r must be >= 1, got 0"),
        ({"r": -2}, "r must be >= 1, got -2"),
        ({"r": 4.5}, "r must be an integer, got 4.5"),
        ({"r": True}, "r must be an integer, got True"),
        ({"rank_pattern": {"q_proj": 32}}, "rank_pattern['q_proj'] = 32 is above max_lora_rank = 8"),
        ({"rank_pattern": {"q_proj": "2"}}, "rank_pattern['q_proj'] must be an integer, got '2'"),
        ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object, got ['q_proj']"),
        ({"lora_alpha": "big"}, "lora_alpha must be a finite number, got 'big'"),
        ({"lora_alpha": math.inf}, "lora_alpha must be a finite number, got inf"),
        ({"alpha_pattern": {"v_proj": math.nan}}, "alpha_pattern['v_proj'] must be a finite number, got nan"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false, got 'yes'"),
        ({"lora_bias": True}, "lora_bias is set; LoRA B bias (lora_bias) is not supported"),
        ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication is set; layer replication (layer_replication) is not supported"),
        ({"use_qalora": True}, "use_qalora is set; QALoRA (use_qalora) is not supported"),
        ({"target_parameters": ["experts"]}, "target_parameters is set; LoRA on raw parameters (target_parameters) is not supported"),
        (
            {"init_lora_weights": "pissa"},
            "init_lora_weights 'pissa': the adapter expects a base model that PEFT modified in place; "
            "convert it with save_pretrained(path_initial_model_for_weight_conversion=...)",
        ),
        ({"target_modules": 7}, "target_modules must be a list of module names or a regex string, got 7"),
        ({"target_modules": ["q_proj", ""]}, "target_modules must be a list of module names or a regex string, got ['q_proj', '']"),
        ({"exclude_modules": {"a": 1}}, "exclude_modules must be a list of module names or a regex string, got {'a': 1}"),
        (
            {"target_modules": "(q_proj"},
            "target_modules: invalid regular expression '(q_proj': missing ), unterminated subpattern at position 0",
        ),
        (
            {"target_modules": ".*q_proj", "layers_to_transform": [0]},
            "layers_to_transform / layers_pattern cannot be used with a regex target_modules",
        ),
        ({"layers_pattern": "layers"}, "layers_pattern is set without layers_to_transform"),
        ({"layers_to_transform": [0, -1]}, "layers_to_transform must be a layer index or a list of them, got [0, -1]"),
        ({"layers_to_transform": "0"}, "layers_to_transform must be a layer index or a list of them, got '0'"),
        ({"layers_to_transform": [0], "layers_pattern": 3}, "layers_pattern must be a string or a list of strings, got 3"),
        ({"base_model_name_or_path": 7}, "base_model_name_or_path must be a string, got 7"),
    ],
)
def test_a_config_refused_with_its_reason(changes: dict, reason: str) -> None:
    assert refused(lora_config(**changes)) == [reason]


def test_every_reason_is_given_in_the_order_the_fields_are_checked() -> None:
    config = lora_config(peft_type="IA3", use_dora=True, bias="all", r=16, lora_alpha="x", target_modules=7)
    assert refused(config) == [
        "peft_type 'IA3' is not supported; only LORA adapters are",
        "use_dora is true; DoRA adapters are not supported",
        "bias 'all' is not supported; only 'none' is",
        "r = 16 is above max_lora_rank = 8",
        "lora_alpha must be a finite number, got 'x'",
        "target_modules must be a list of module names or a regex string, got 7",
    ]


def test_the_max_rank_is_the_callers() -> None:
    settings, reasons = parse_settings(lora_config(r=16), max_lora_rank=16)
    assert reasons == [] and settings.r == 16

"""check_adapter_dir: every rule over a whole directory, every reason in the order the steps run
(so the first is what a stop-at-first check gives), steps skipped only where their input was
refused, and the two callers' switches (upload policy, strict base match, value scan)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from protocol.adapter_format import check_adapter_dir
from tests.protocol.adapter_format.peft_files import (
    TINY,
    lora_config,
    lora_tensors,
    tensor_key,
    write_adapter,
)

Q_A = tensor_key(0, "q_proj", "A")


def test_a_good_adapter_with_what_each_step_parsed(tmp_path) -> None:
    check = check_adapter_dir(write_adapter(tmp_path / "a"), TINY)
    assert check.ok and check.reasons == [] and check.warnings == []
    assert check.config == lora_config() and check.settings.r == 4
    assert check.targets == {(layer, m): (4, 8.0) for layer in (0, 1) for m in ("q_proj", "v_proj")}
    assert set(check.pairs) == set(check.targets) and len(check.header) == 8


def test_not_a_directory(tmp_path) -> None:
    check = check_adapter_dir(tmp_path / "nowhere", TINY)
    assert not check.ok and check.reasons == [f"{tmp_path / 'nowhere'} is not a directory"]


def test_every_step_reports_in_order(tmp_path) -> None:
    t = lora_tensors()
    t[Q_A] = np.full((4, 17), np.nan, np.float32)
    directory = write_adapter(tmp_path / "a", config=lora_config(use_dora=True, r=16), tensors=t)
    (directory / "optimizer.pt").write_bytes(b"\x80\x04N.")
    reasons = check_adapter_dir(directory, TINY).reasons
    assert [r.split(" ")[:2] for r in reasons] == [
        ["optimizer.pt", "is"],
        ["use_dora", "is"],
        ["r", "="],
        ["tensor", repr(Q_A)],  # shape, checked without targets: the config was refused
        ["tensor", repr(Q_A)],  # NaN
    ]
    assert reasons[3].endswith("[r=4, in_features=16]") and reasons[4].endswith("contains NaN values")


def test_the_base_name_is_judged_after_the_tensors_and_before_the_values(tmp_path) -> None:
    t = lora_tensors()
    t[tensor_key(1, "v_proj", "B")] = np.zeros((9, 4), np.float32)
    t[Q_A][0, 0] = np.inf
    config = lora_config(base_model_name_or_path="meta-llama/Llama-3.1-8B")
    reasons = check_adapter_dir(write_adapter(tmp_path / "a", config=config, tensors=t), TINY).reasons
    assert [r.split(" ")[0] for r in reasons] == ["tensor", "base_model_name_or_path", "tensor"]
    assert "has shape [9, 4]" in reasons[0] and reasons[2].endswith("contains Inf values")


def test_a_refused_target_leaves_the_tensors_checked_without_targets(tmp_path) -> None:
    config = lora_config(target_modules=["q_proj", "lm_head"])
    check = check_adapter_dir(write_adapter(tmp_path / "a", config=config), TINY)
    assert check.settings is not None and check.targets is None and check.pairs is not None
    assert len(check.reasons) == 1 and "'lm_head' selects lm_head" in check.reasons[0]


def test_a_corrupt_file_stops_the_tensor_checks_but_not_the_config_checks(tmp_path) -> None:
    directory = write_adapter(tmp_path / "a", config=lora_config(bias="all"))
    weights = directory / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    check = check_adapter_dir(directory, TINY)
    assert check.header is None and check.pairs is None
    assert check.reasons[0] == "bias 'all' is not supported; only 'none' is"
    assert check.reasons[1].startswith("adapter_model.safetensors is corrupt or truncated: ") and len(check.reasons) == 2


def test_missing_files_skip_what_they_would_feed(tmp_path) -> None:
    directory = tmp_path / "a"
    directory.mkdir()
    check = check_adapter_dir(directory, TINY)
    assert check.reasons == ["missing adapter_config.json", "missing adapter_model.safetensors"]
    assert (check.config, check.header) == (None, None)


def test_the_upload_policy_refuses_what_the_engine_leaves_alone(tmp_path) -> None:
    directory = write_adapter(tmp_path / "a")
    (directory / "model.gguf").write_bytes(b"GGUF")
    assert check_adapter_dir(directory, TINY).ok
    [reason] = check_adapter_dir(directory, TINY, upload=True).reasons
    assert reason.startswith("model.gguf is not a file PEFT or the HF Trainer writes")


def test_the_max_rank_is_the_bases(tmp_path) -> None:
    directory = write_adapter(tmp_path / "a")
    assert check_adapter_dir(directory, dataclasses.replace(TINY, max_lora_rank=3)).reasons == [
        "r = 4 is above max_lora_rank = 3"
    ]


def test_an_uncomparable_base_name_warns_or_is_refused_when_strict(tmp_path) -> None:
    directory = write_adapter(tmp_path / "a", config=lora_config(base_model_name_or_path=None))
    check = check_adapter_dir(directory, TINY)
    assert check.ok and check.warnings == [
        "base_model_name_or_path is missing; accepted because every tensor shape matches the served base "
        f"{TINY.name!r}"
    ]
    strict = check_adapter_dir(directory, TINY, strict_base_match=True)
    assert strict.warnings == [] and strict.reasons == [
        f"base_model_name_or_path is missing; strict_base_match requires it to name the served base {TINY.name!r}"
    ]


@pytest.mark.parametrize("check_values", [True, False])
def test_the_value_scan_is_the_callers_choice(tmp_path, check_values: bool) -> None:
    t = lora_tensors()
    t[Q_A][2, 2] = np.nan
    check = check_adapter_dir(write_adapter(tmp_path / "a", tensors=t), TINY, check_values=check_values)
    assert check.reasons == ([f"tensor {Q_A!r} contains NaN values"] if check_values else [])

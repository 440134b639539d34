"""The portal wires the adapter rules (protocol.adapter_format, whose own tests cover every rule):
validate_adapter_dir judges an extracted upload with the upload policy, shows the tenant every
reason (a bounded list), and records a ready version's facts and file hashes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from portal.adapters.validation import MAX_REASONS, SMOLLM2_135M, validate_adapter_dir
from tests.portal.adapters.peft_files import TINY, peft_config, write_peft

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_a_good_adapter_passes_with_its_facts(tmp_path) -> None:
    result = validate_adapter_dir(write_peft(tmp_path / "a", rank=4), TINY)
    assert result.ok and result.reasons == [] and result.warnings == []
    assert (result.rank, result.alpha, result.target_modules) == (4, 8.0, ["q_proj", "v_proj"])
    assert result.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert set(result.file_sha256) == {"adapter_config.json", "adapter_model.safetensors"}
    assert result.size_bytes == sum(p.stat().st_size for p in (tmp_path / "a").iterdir())


def test_the_largest_rank_and_the_targets_in_model_order(tmp_path) -> None:
    config = peft_config(target_modules=["v_proj", "q_proj"], rank_pattern={"v_proj": 2})

    def narrow_v(t):
        for k in [k for k in t if "v_proj" in k]:
            t[k] = t[k][:2] if "lora_A" in k else t[k][:, :2]

    result = validate_adapter_dir(write_peft(tmp_path / "a", config=config, edit=narrow_v), TINY)
    assert result.ok, result.reasons
    assert (result.rank, result.target_modules) == (4, ["q_proj", "v_proj"])


def test_the_default_models_shapes(tmp_path) -> None:
    result = validate_adapter_dir(write_peft(tmp_path / "a", SMOLLM2_135M, rank=2), SMOLLM2_135M)
    assert result.ok, result.reasons
    assert not validate_adapter_dir(write_peft(tmp_path / "b", TINY), SMOLLM2_135M).ok


def test_every_independent_reason_is_shown(tmp_path) -> None:
    def break_it(t):
        t[Q_A] = np.full((4, 17), np.nan, np.float32)

    config = peft_config(use_dora=True, modules_to_save=["lm_head"], r=16)
    directory = write_peft(tmp_path / "a", config=config, edit=break_it)
    (directory / "training_args.bin").write_bytes(b"\x80\x04N.")
    result = validate_adapter_dir(directory, TINY)
    assert not result.ok and result.file_sha256 == {} and result.rank is None
    expected = ("training_args.bin is a pickle file", "DoRA", "modules_to_save", "r = 16 is above max_lora_rank = 8",
                "has shape [4, 17]", "contains NaN values")
    assert len(result.reasons) == len(expected)
    for want, reason in zip(expected, result.reasons, strict=True):
        assert want in reason, (want, result.reasons)


def test_a_long_list_of_reasons_is_cut_with_a_count(tmp_path) -> None:
    def many_strangers(t):
        for i in range(MAX_REASONS + 5):
            t[f"base_model.model.stranger_{i:02}.weight"] = np.zeros(2, np.float32)

    result = validate_adapter_dir(write_peft(tmp_path / "a", edit=many_strangers), TINY)
    assert len(result.reasons) == MAX_REASONS + 1
    assert result.reasons[-1] == "... and 5 more problems of the same kinds"


def test_the_upload_policy_applies(tmp_path) -> None:
    directory = write_peft(tmp_path / "a")
    (directory / "README.md").write_text("# card")
    (directory / "tokenizer.json").write_text("{}")
    result = validate_adapter_dir(directory, TINY)
    assert result.ok and set(result.file_sha256) == {"adapter_config.json", "adapter_model.safetensors"}
    (directory / "model.gguf").write_bytes(b"GGUF")
    [reason] = validate_adapter_dir(directory, TINY).reasons
    assert reason.startswith("model.gguf is not a file PEFT or the HF Trainer writes beside an adapter")


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links here")
def test_a_linked_adapter_file_is_refused(tmp_path) -> None:
    real = write_peft(tmp_path / "real")
    directory = tmp_path / "a"
    directory.mkdir()
    (directory / "adapter_config.json").write_bytes((real / "adapter_config.json").read_bytes())
    (directory / "adapter_model.safetensors").symlink_to(real / "adapter_model.safetensors")
    assert validate_adapter_dir(directory, TINY).reasons == [
        "adapter_model.safetensors is a symbolic link; links are not accepted",
        "missing adapter_model.safetensors",
    ]


def test_a_missing_base_name_is_a_warning_only(tmp_path) -> None:
    result = validate_adapter_dir(write_peft(tmp_path / "a", config=peft_config(base_model_name_or_path=None)), TINY)
    assert result.ok and result.warnings == [
        "base_model_name_or_path is missing; accepted because every tensor shape matches the served base "
        f"{TINY.name!r}"
    ]


def test_base_shapes_from_the_fleet(db, monkeypatch) -> None:
    from portal.adapters import selectors
    from portal.fleet.models import InferenceWorker

    monkeypatch.undo()  # the autouse fixture replaced base_shapes_current with TINY
    assert selectors.base_shapes_current() == SMOLLM2_135M  # nothing polled yet: the default
    InferenceWorker.objects.create(
        url="http://w1:8001", healthy=True, base_model="smollm2",
        base_config={"name": "smollm2", "checkpoint_name": "Smollm2 135M 8k Lc100K Mix1 Ep2", "num_hidden_layers": 2,
                     "hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 8, "max_lora_rank": 32},
    )
    shapes = selectors.base_shapes_current()
    assert (shapes.num_hidden_layers, shapes.max_lora_rank, shapes.name) == (2, 32, "Smollm2 135M 8k Lc100K Mix1 Ep2")

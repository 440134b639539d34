"""Every way an adapter is refused: one good PEFT adapter is saved once, and each test breaks
a copy of it the way real uploads go wrong, then checks the AdapterError names the adapter and
says why. Nothing here is ever unpickled."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.lora.adapter import load_adapter
from inference.lora.validation import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    ModelName,
    parse_model_name,
)
from tests.inference.lora.peft_adapters import SERVED_NAME, tiny_config, write_peft_adapter

SUPPORTED = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """r=4 on all seven projections of every layer of the tiny base."""
    path = tmp_path_factory.mktemp("good")
    write_peft_adapter(
        path,
        r=4,
        lora_alpha=8,
        target_modules=[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    )
    return path


@pytest.fixture
def adapter_dir(good_dir: Path, tmp_path: Path) -> Path:
    """A fresh copy of the good adapter for a test to break."""
    return Path(shutil.copytree(good_dir, tmp_path / "bad"))


def load(path: Path, **kwargs):
    kwargs.setdefault("max_lora_rank", 8)
    return load_adapter(path, "bad", kwargs.pop("base", None) or tiny_config(), **kwargs)


def refused(path: Path, **kwargs) -> str:
    """Load must fail with an AdapterError about adapter 'bad'; returns its reason."""
    with pytest.raises(AdapterError) as info:
        load(path, **kwargs)
    err = info.value
    assert isinstance(err, ValueError) and err.adapter == "bad"
    assert str(err) == f"adapter 'bad': {err.reason}"
    return err.reason


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def edit_tensors(path: Path, edit) -> None:
    tensors = load_file(path / WEIGHTS_FILE)
    edit(tensors)
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})


def test_good_adapter_loads(adapter_dir: Path) -> None:
    adapter = load(adapter_dir)
    assert len(adapter.weights) == 3 * 7 and adapter.warnings == ()


def test_adapter_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(AdapterError("x", "why")))
    assert (err.adapter, err.reason, str(err)) == ("x", "why", "adapter 'x': why")


# --- files -------------------------------------------------------------------------------------


class _WouldRun:
    """Unpickling this creates `marker`: proof that nobody unpickled the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@pytest.mark.parametrize(
    "filename", ["adapter_model.bin", "optimizer.pt", "state.pkl", "rng_state.pth"]
)
def test_pickle_file_refused_without_unpickling(
    adapter_dir: Path, tmp_path: Path, filename: str
) -> None:
    marker = tmp_path / "unpickled"
    (adapter_dir / filename).write_bytes(pickle.dumps(_WouldRun(marker)))
    assert refused(adapter_dir) == f"contains pickle file {filename}; only safetensors are accepted"
    assert not marker.exists()


def test_pickle_file_in_a_subdirectory_refused(adapter_dir: Path) -> None:
    (adapter_dir / "checkpoint-10").mkdir()
    (adapter_dir / "checkpoint-10" / "training_args.bin").write_bytes(b"\x80\x04N.")
    assert refused(adapter_dir) == (
        "contains pickle file checkpoint-10/training_args.bin; only safetensors are accepted"
    )


def test_not_a_directory(tmp_path: Path) -> None:
    assert refused(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'} is not a directory"


def test_missing_config(adapter_dir: Path) -> None:
    (adapter_dir / CONFIG_FILE).unlink()
    assert refused(adapter_dir) == "missing adapter_config.json"


def test_missing_safetensors(adapter_dir: Path) -> None:
    (adapter_dir / WEIGHTS_FILE).unlink()
    assert refused(adapter_dir) == "missing adapter_model.safetensors"


@pytest.mark.parametrize("text", ['{"peft_type": "LORA", "r": 4', "", "not json"])
def test_malformed_json(adapter_dir: Path, text: str) -> None:
    (adapter_dir / CONFIG_FILE).write_text(text)
    assert refused(adapter_dir).startswith("adapter_config.json is not valid JSON: ")


def test_config_not_an_object(adapter_dir: Path) -> None:
    (adapter_dir / CONFIG_FILE).write_text("[1, 2]")
    assert refused(adapter_dir) == "adapter_config.json must hold a JSON object, got list"


# --- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, reason",
    [
        (
            {"peft_type": "PREFIX_TUNING"},
            "peft_type 'PREFIX_TUNING' is not supported; only LORA adapters are",
        ),
        (
            {"peft_type": None},
            "adapter_config.json has no peft_type; only LORA adapters are supported",
        ),
        ({"use_dora": True}, "use_dora is true; DoRA adapters are not supported"),
        (
            {"modules_to_save": ["lm_head"]},
            "modules_to_save ['lm_head'] is not supported (it replaces whole base modules)",
        ),
        ({"bias": "all"}, "bias 'all' is not supported; only 'none' is"),
        ({"bias": "lora_only"}, "bias 'lora_only' is not supported; only 'none' is"),
        ({"r": 16}, "r = 16 is above max_lora_rank = 8"),
        ({"r": 0}, "r must be >= 1, got 0"),
        ({"r": -2}, "r must be >= 1, got -2"),
        ({"r": 4.5}, "r must be an integer, got 4.5"),
        (
            {"rank_pattern": {"q_proj": 32}},
            "rank_pattern['q_proj'] = 32 is above max_lora_rank = 8",
        ),
        ({"lora_alpha": "big"}, "lora_alpha must be a finite number, got 'big'"),
        ({"use_rslora": "yes"}, "use_rslora must be true or false, got 'yes'"),
        ({"lora_bias": True}, "lora_bias is set; LoRA B bias (lora_bias) is not supported"),
        (
            {"layer_replication": [[0, 2], [1, 3]]},
            "layer_replication is set; layer replication (layer_replication) is not supported",
        ),
        (
            {"init_lora_weights": "pissa"},
            "init_lora_weights 'pissa': the adapter expects a base model that PEFT modified in place; "
            "convert it with save_pretrained(path_initial_model_for_weight_conversion=...)",
        ),
        (
            {"target_modules": 7},
            "target_modules must be a list of module names or a regex string, got 7",
        ),
        (
            {"target_modules": "(q_proj"},
            "target_modules: invalid regular expression '(q_proj': missing ), unterminated subpattern at position 0",
        ),
    ],
)
def test_config_refused(adapter_dir: Path, changes: dict, reason: str) -> None:
    edit_config(adapter_dir, **changes)
    assert refused(adapter_dir) == reason


@pytest.mark.parametrize(
    "target_modules, reason",
    [
        (["q_proj", "embed_tokens"], "target_modules 'embed_tokens' selects model.embed_tokens"),
        (["lm_head", "v_proj"], "target_modules 'lm_head' selects lm_head"),
        (["mlp"], "target_modules 'mlp' selects model.layers.0.mlp"),
        (r".*(q_proj|lm_head)", r"target_modules '.*(q_proj|lm_head)' selects lm_head"),
    ],
)
def test_unsupported_target_module(adapter_dir: Path, target_modules, reason: str) -> None:
    edit_config(adapter_dir, target_modules=target_modules)
    assert refused(adapter_dir) == (
        f"{reason}, which is not a supported target module (supported: {SUPPORTED})"
    )


def test_target_module_matching_nothing(adapter_dir: Path) -> None:
    edit_config(adapter_dir, target_modules=["q_proj", "c_attn"])
    assert refused(adapter_dir) == (
        f"target_modules entry 'c_attn' matches no module of the base model (supported: {SUPPORTED})"
    )


def test_layers_to_transform_beyond_the_base(adapter_dir: Path) -> None:
    edit_config(adapter_dir, layers_to_transform=[0, 5])
    assert refused(adapter_dir) == "layers_to_transform names layer 5; the base model has 3 layers"


def test_layers_to_transform_with_regex_targets(adapter_dir: Path) -> None:
    edit_config(adapter_dir, target_modules=".*q_proj", layers_to_transform=[0])
    assert refused(adapter_dir) == (
        "layers_to_transform / layers_pattern cannot be used with a regex target_modules"
    )


# --- tensors -----------------------------------------------------------------------------------


def rename(old: str, new: str):
    def edit(tensors):
        tensors[new] = tensors.pop(old)

    return edit


def test_tensor_for_a_layer_the_base_does_not_have(adapter_dir: Path) -> None:
    edit_tensors(adapter_dir, rename(Q_A, Q_A.replace("layers.0.", "layers.7.")))
    assert refused(adapter_dir) == (
        f"tensor {Q_A.replace('layers.0.', 'layers.7.')!r} is for layer 7; the base model has "
        "3 layers (0-2)"
    )


@pytest.mark.parametrize("module", ["self_attn.rotary_proj", "mlp.q_proj", "self_attn.lm_head"])
def test_tensor_for_a_module_the_base_does_not_have(adapter_dir: Path, module: str) -> None:
    new = Q_A.replace("self_attn.q_proj", module)
    edit_tensors(adapter_dir, rename(Q_A, new))
    assert refused(adapter_dir) == (
        f"tensor {new!r} is for module {module}, which the base model does not have as a LoRA "
        f"target (supported: {SUPPORTED})"
    )


@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.lm_head.weight",  # a modules_to_save copy
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",  # DoRA
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",  # lora_bias
        "base_model.model.model.embed_tokens.lora_embedding_A",
    ],
)
def test_unexpected_tensor(adapter_dir: Path, key: str) -> None:
    edit_tensors(adapter_dir, lambda t: t.__setitem__(key, torch.zeros(4, 64)))
    assert refused(adapter_dir) == (
        f"unexpected tensor {key!r}: not the lora_A/lora_B weight of a decoder layer's projection"
    )


def test_tensor_for_a_module_the_config_does_not_target(adapter_dir: Path) -> None:
    edit_config(adapter_dir, target_modules=["q_proj", "v_proj"])
    reason = refused(adapter_dir)
    assert reason == (
        "tensor 'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' is for "
        "model.layers.0.mlp.down_proj, which adapter_config.json does not target "
        "(target_modules / exclude_modules / layers_to_transform)"
    )


@pytest.mark.parametrize("missing", ["A", "B"])
def test_missing_half_of_a_pair(adapter_dir: Path, missing: str) -> None:
    gone, kept = (Q_A, Q_B) if missing == "A" else (Q_B, Q_A)
    edit_tensors(adapter_dir, lambda t: t.pop(gone))
    assert refused(adapter_dir) == (
        f"model.layers.0.self_attn.q_proj has {kept!r} but no lora_{missing} weight"
    )


def test_shape_not_matching_the_base(adapter_dir: Path) -> None:
    base = dataclasses.replace(tiny_config(), intermediate_size=128)  # the adapter saw 192
    assert refused(adapter_dir, base=base) == (
        "tensor 'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' has shape [4, 192]; "
        "model.layers.0.mlp.down_proj of the base model needs [4, 128] [r=4, in_features=128]"
    )


def test_b_shape_not_matching_the_base(adapter_dir: Path) -> None:
    edit_tensors(adapter_dir, lambda t: t.__setitem__(Q_B, torch.ones(60, 4)))
    assert refused(adapter_dir) == (
        f"tensor {Q_B!r} has shape [60, 4]; model.layers.0.self_attn.q_proj of the base model "
        "needs [64, 4] [out_features=64, r=4]"
    )


def test_rank_in_config_not_matching_the_tensors(adapter_dir: Path) -> None:
    edit_config(adapter_dir, r=8)
    assert "has shape [4, 192]; model.layers.0.mlp.down_proj of the base model needs [8, 192]" in (
        refused(adapter_dir)
    )


@pytest.mark.parametrize(
    "value, word", [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")]
)
def test_non_finite_weights(adapter_dir: Path, value: float, word: str) -> None:
    key = "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"
    edit_tensors(adapter_dir, lambda t: t[key].__setitem__((3, 1), value))
    assert refused(adapter_dir) == f"tensor {key!r} contains {word} values"


def test_weights_that_overflow_the_serving_dtype(adapter_dir: Path) -> None:
    edit_tensors(adapter_dir, lambda t: t[Q_B].__setitem__((0, 0), 1e38))
    edit_config(adapter_dir, lora_alpha=400)  # scale 100: 1e40 overflows float32
    reason = refused(adapter_dir)
    assert reason == f"tensor '{Q_B} (scaled by 100, as torch.float32)' contains Inf values"


def test_integer_tensor(adapter_dir: Path) -> None:
    edit_tensors(adapter_dir, lambda t: t.__setitem__(Q_A, torch.ones(4, 64, dtype=torch.int32)))
    assert refused(adapter_dir) == (
        f"tensor {Q_A!r} has dtype I32; expected one of ('F16', 'BF16', 'F32', 'F64')"
    )


def test_empty_adapter(adapter_dir: Path) -> None:
    save_file({}, adapter_dir / WEIGHTS_FILE)
    assert refused(adapter_dir) == "adapter_model.safetensors holds no tensors (empty adapter)"


# --- corrupt safetensors -------------------------------------------------------------------------


def corrupt_reason(reason: str) -> None:
    assert reason.startswith("adapter_model.safetensors is corrupt or truncated: "), reason


def test_truncated_safetensors(adapter_dir: Path) -> None:
    path = adapter_dir / WEIGHTS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    corrupt_reason(refused(adapter_dir))


def test_header_length_beyond_the_file(adapter_dir: Path) -> None:
    (adapter_dir / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 10_000_000) + b'{"a":')
    corrupt_reason(refused(adapter_dir))


@pytest.mark.parametrize("content", [b"", b"\x01\x02", struct.pack("<Q", 4) + b"{{{{"])
def test_garbage_safetensors(adapter_dir: Path, content: bytes) -> None:
    (adapter_dir / WEIGHTS_FILE).write_bytes(content)
    corrupt_reason(refused(adapter_dir))


def test_data_offsets_beyond_the_file(adapter_dir: Path) -> None:
    path = adapter_dir / WEIGHTS_FILE
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    last = max(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1]
    )
    header[last]["data_offsets"][1] += 4096
    new_header = json.dumps(header).encode()
    new_header += b" " * (-len(new_header) % 8)
    path.write_bytes(struct.pack("<Q", len(new_header)) + new_header + data[8 + n :])
    corrupt_reason(refused(adapter_dir))


# --- base_model_name_or_path ---------------------------------------------------------------------


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
def test_base_model_that_names_another_model(adapter_dir: Path, claimed: str) -> None:
    edit_config(adapter_dir, base_model_name_or_path=claimed)
    assert refused(adapter_dir) == (
        f"base_model_name_or_path {claimed!r} names a different model than the served base "
        f"{SERVED_NAME!r}"
    )


@pytest.mark.parametrize(
    "claimed", ["HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M", "smollm2-135m"]
)
def test_base_model_that_names_the_served_model(adapter_dir: Path, claimed: str) -> None:
    edit_config(adapter_dir, base_model_name_or_path=claimed)
    assert load(adapter_dir, strict_base_match=True).warnings == ()


@pytest.mark.parametrize(
    "claimed, why",
    [
        ("/home/me/checkpoints/base", "'/home/me/checkpoints/base' is not a recognisable model id"),
        ("my-favourite-model", "'my-favourite-model' is not a recognisable model id"),
        (None, "is missing"),
    ],
)
def test_unrecognisable_base_accepted_with_warning_or_refused_when_strict(
    adapter_dir: Path, claimed, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    edit_config(adapter_dir, base_model_name_or_path=claimed)
    warning = (
        f"adapter 'bad': base_model_name_or_path {why}; accepted because every tensor shape "
        f"matches the served base {SERVED_NAME!r}"
    )
    with caplog.at_level(logging.WARNING, logger="inference.lora.adapter"):
        adapter = load(adapter_dir)
    assert adapter.warnings == (warning,)
    assert warning in caplog.messages
    assert refused(adapter_dir, strict_base_match=True) == (
        f"base_model_name_or_path {why}; strict_base_match requires it to name the served base "
        f"{SERVED_NAME!r}"
    )


def test_unrecognisable_served_name_cannot_be_compared(adapter_dir: Path) -> None:
    base = tiny_config(name="tiny-checkpoint")
    adapter = load(adapter_dir, base=base)
    assert adapter.warnings and "cannot be compared with the served base" in adapter.warnings[0]
    assert "strict_base_match requires" in refused(adapter_dir, base=base, strict_base_match=True)


def test_base_name_checked_only_after_shapes(adapter_dir: Path) -> None:
    """A different model with different shapes is refused for its shapes, the precise reason."""
    edit_config(adapter_dir, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    base = dataclasses.replace(tiny_config(), intermediate_size=128)
    assert "has shape [4, 192]" in refused(adapter_dir, base=base)


@pytest.mark.parametrize(
    "name, parsed",
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", ModelName("smollm2", 135e6)),
        ("Smollm2 135M 8k Lc100K Mix1 Ep2", ModelName("smollm2", 135e6)),
        ("meta-llama/Llama-3.1-8B", ModelName("llama31", 8e9)),
        ("mistralai/Mixtral-8x7B-v0.1", ModelName("mixtral", 56e9)),
        ("Qwen/Qwen2.5-0.5B-Instruct", ModelName("qwen25", 0.5e9)),
        ("/home/me/ckpt", None),
        ("135M", None),
        ("", None),
    ],
)
def test_parse_model_name(name: str, parsed) -> None:
    assert parse_model_name(name) == parsed

"""adapter_model.safetensors: a file safetensors itself would refuse, tensors that are not the
A/B of a targeted projection of this base, and NaN/Inf in any float format. Nothing here is
ever unpickled."""

from __future__ import annotations

import json
import pickle
import struct

import numpy as np
import pytest

from protocol.adapter_format import tensors
from protocol.adapter_format.tensors import check_tensors, nonfinite, read_header, scan_values
from tests.protocol.adapter_format.peft_files import (
    BF16,
    TINY,
    lora_tensors,
    save_tensors,
    tensor_key,
)

SUPPORTED = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
Q_A, Q_B = tensor_key(0, "q_proj", "A"), tensor_key(0, "q_proj", "B")
QV = {(layer, m): (4, 8.0) for layer in (0, 1) for m in ("q_proj", "v_proj")}  # resolved targets


@pytest.fixture
def weights(tmp_path):
    path = tmp_path / "adapter_model.safetensors"
    save_tensors(path, lora_tensors())
    return path


def header_of(tensor_dict: dict, tmp_path) -> dict:
    path = tmp_path / "w.safetensors"
    save_tensors(path, tensor_dict)
    header, reasons = read_header(path)
    assert reasons == [], reasons
    return header


def reasons_for(tensor_dict: dict, tmp_path, targets=QV) -> list[str]:
    pairs, reasons = check_tensors(header_of(tensor_dict, tmp_path), targets, TINY)
    assert pairs is None and reasons
    return reasons


# --- the file -----------------------------------------------------------------------------------


def test_the_header_gives_each_tensors_dtype_shape_and_data(weights) -> None:
    header, reasons = read_header(weights)
    assert reasons == [] and len(header) == 8
    info = header[tensor_key(1, "v_proj", "B")]
    assert (info.dtype, info.shape) == ("F32", (8, 4))
    data = weights.read_bytes()[info.start : info.end]
    assert np.array_equal(np.frombuffer(data, np.float32).reshape(8, 4), lora_tensors()[tensor_key(1, "v_proj", "B")])


def test_an_empty_adapter(tmp_path) -> None:
    save_tensors(tmp_path / "w", {})
    assert read_header(tmp_path / "w") == (None, ["adapter_model.safetensors holds no tensors (empty adapter)"])


def corrupt(path) -> str:
    header, [reason] = read_header(path)
    assert header is None and reason.startswith("adapter_model.safetensors is corrupt or truncated: "), reason
    return reason


@pytest.mark.parametrize("keep", [4, 100, -10, "two thirds"])
def test_a_truncated_file(weights, keep) -> None:
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) * 2 // 3] if keep == "two thirds" else data[:keep])
    corrupt(weights)


def test_bytes_after_the_last_tensor(weights) -> None:
    weights.write_bytes(weights.read_bytes() + b"\0" * 8)
    corrupt(weights)


@pytest.mark.parametrize("content", [b"", b"\x01\x02", struct.pack("<Q", 4) + b"{{{{", struct.pack("<Q", 5) + b"[1,2]"])
def test_garbage(weights, content: bytes) -> None:
    weights.write_bytes(content)
    corrupt(weights)


def test_a_header_length_beyond_the_file(weights) -> None:
    weights.write_bytes(struct.pack("<Q", 10_000_000) + b'{"a":')
    corrupt(weights)


def rewrite_header(path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])


def test_data_offsets_beyond_the_file(weights) -> None:
    def stretch_the_last(header):
        last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
        header[last]["data_offsets"][1] += 4096

    rewrite_header(weights, stretch_the_last)
    corrupt(weights)


def test_a_shape_that_does_not_fit_its_bytes(weights) -> None:
    rewrite_header(weights, lambda h: h[Q_A].__setitem__("shape", [4, 17]))
    corrupt(weights)


def test_an_unknown_dtype(weights) -> None:
    rewrite_header(weights, lambda h: h[Q_A].__setitem__("dtype", "Q4"))
    assert "unknown variant `Q4`" in corrupt(weights)


class _WouldRun:
    """Unpickling this creates `marker`: proof that nobody unpickled the file."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_in_place_of_the_safetensors_is_never_unpickled(weights, tmp_path) -> None:
    weights.write_bytes(pickle.dumps(_WouldRun(tmp_path / "unpickled")))
    corrupt(weights)
    assert not (tmp_path / "unpickled").exists()


# --- names and shapes -----------------------------------------------------------------------------


def test_every_tensor_paired_with_its_projection(tmp_path) -> None:
    pairs, reasons = check_tensors(header_of(lora_tensors(), tmp_path), QV, TINY)
    assert reasons == [] and pairs == {(layer, m): (tensor_key(layer, m, "A"), tensor_key(layer, m, "B")) for layer, m in QV}


def test_a_targeted_projection_may_have_no_tensors(tmp_path) -> None:
    pairs, reasons = check_tensors(header_of(lora_tensors(targets=("q_proj",)), tmp_path), QV, TINY)
    assert reasons == [] and set(pairs) == {(0, "q_proj"), (1, "q_proj")}


@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",  # PEFT with the adapter name
        "base_model.model.layers.0.self_attn.q_proj.lora_A.weight",  # saved from a bare LlamaModel
    ],
)
def test_the_other_names_peft_writes(tmp_path, key) -> None:
    t = lora_tensors()
    t[key] = t.pop(Q_A)
    pairs, reasons = check_tensors(header_of(t, tmp_path), QV, TINY)
    assert reasons == [] and pairs[(0, "q_proj")] == (key, Q_B)


@pytest.mark.parametrize(
    "key",
    [
        "base_model.model.lm_head.weight",  # a modules_to_save copy
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector",  # DoRA
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias",  # lora_bias
        "base_model.model.model.embed_tokens.lora_embedding_A",
    ],
)
def test_an_unexpected_tensor(tmp_path, key: str) -> None:
    assert reasons_for({**lora_tensors(), key: np.zeros((4, 16), np.float32)}, tmp_path) == [
        f"unexpected tensor {key!r}: not the lora_A/lora_B weight of a decoder layer's projection"
    ]


def test_a_tensor_for_a_layer_the_base_does_not_have(tmp_path) -> None:
    key = Q_A.replace("layers.0.", "layers.7.")
    assert reasons_for({**lora_tensors(), key: np.zeros((4, 16), np.float32)}, tmp_path) == [
        f"tensor {key!r} is for layer 7; the base model has 2 layers (0-1)"
    ]


@pytest.mark.parametrize("module", ["self_attn.rotary_proj", "mlp.q_proj", "self_attn.lm_head"])
def test_a_tensor_for_a_module_the_base_does_not_have(tmp_path, module: str) -> None:
    key = Q_A.replace("self_attn.q_proj", module)
    assert reasons_for({**lora_tensors(), key: np.zeros((4, 16), np.float32)}, tmp_path) == [
        f"tensor {key!r} is for module {module}, which the base model does not have as a LoRA target "
        f"(supported: {SUPPORTED})"
    ]


def test_a_tensor_for_a_projection_the_config_does_not_target(tmp_path) -> None:
    reasons = reasons_for(lora_tensors(targets=("q_proj", "v_proj", "down_proj")), tmp_path)
    assert reasons[0] == (
        f"tensor {tensor_key(0, 'down_proj', 'A')!r} is for model.layers.0.mlp.down_proj, which adapter_config.json "
        "does not target (target_modules / exclude_modules / layers_to_transform)"
    )
    assert len(reasons) == 4  # A and B of both layers


def test_the_same_weight_twice(tmp_path) -> None:
    t = lora_tensors()
    other = Q_A.replace("lora_A.weight", "lora_A.default.weight")
    t[other] = t[Q_A]
    assert reasons_for(t, tmp_path) == [f"tensors {other!r} and {Q_A!r} are the same weight"]


@pytest.mark.parametrize("missing", ["A", "B"])
def test_half_a_pair(tmp_path, missing: str) -> None:
    gone, kept = (Q_A, Q_B) if missing == "A" else (Q_B, Q_A)
    t = lora_tensors()
    del t[gone]
    assert reasons_for(t, tmp_path) == [f"model.layers.0.self_attn.q_proj has {kept!r} but no lora_{missing} weight"]


def test_an_a_shape_that_does_not_fit_the_base(tmp_path) -> None:
    assert reasons_for({**lora_tensors(), Q_A: np.zeros((4, 17), np.float32)}, tmp_path) == [
        f"tensor {Q_A!r} has shape [4, 17]; model.layers.0.self_attn.q_proj of the base model needs [4, 16] "
        "[r=4, in_features=16]"
    ]


def test_a_b_shape_that_does_not_fit_the_base(tmp_path) -> None:
    assert reasons_for({**lora_tensors(), Q_B: np.zeros((15, 4), np.float32)}, tmp_path) == [
        f"tensor {Q_B!r} has shape [15, 4]; model.layers.0.self_attn.q_proj of the base model needs [16, 4] "
        "[out_features=16, r=4]"
    ]


def test_a_rank_that_is_not_the_configs(tmp_path) -> None:
    reasons = reasons_for(lora_tensors(), tmp_path, targets={k: (8, 8.0) for k in QV})
    assert reasons[0] == (
        f"tensor {Q_A!r} has shape [4, 16]; model.layers.0.self_attn.q_proj of the base model needs [8, 16] "
        "[r=8, in_features=16]"
    )
    assert len(reasons) == 8


def test_an_integer_tensor(tmp_path) -> None:
    assert reasons_for({**lora_tensors(), Q_A: np.ones((4, 16), np.int32)}, tmp_path) == [
        f"tensor {Q_A!r} has dtype I32; expected one of ('F16', 'BF16', 'F32', 'F64')"
    ]


def test_without_targets_what_the_config_does_not_decide_is_still_checked(tmp_path) -> None:
    t = {**lora_tensors(targets=("q_proj", "down_proj")), Q_B: np.zeros((15, 4), np.float32)}
    reasons = reasons_for(t, tmp_path, targets=None)
    assert reasons == [
        f"tensor {Q_B!r} has shape [15, 4]; model.layers.0.self_attn.q_proj of the base model needs [16, 4] "
        "[out_features=16, r=4]"
    ]


def test_every_independent_problem_is_reported(tmp_path) -> None:
    t = lora_tensors()
    t["base_model.model.lm_head.weight"] = np.zeros(3, np.float32)
    t[Q_A] = np.zeros((4, 17), np.float32)
    del t[tensor_key(1, "v_proj", "B")]
    reasons = reasons_for(t, tmp_path)
    assert [r.split(" ")[0] for r in reasons] == ["unexpected", "tensor", "model.layers.1.self_attn.v_proj"]


# --- values -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "name"), [(np.float16, "F16"), (np.float32, "F32"), (np.float64, "F64")])
@pytest.mark.parametrize(("value", "kind"), [(np.nan, "NaN"), (np.inf, "Inf"), (-np.inf, "Inf"), (1.0, None)])
def test_nonfinite_in_each_float_format(dtype, name, value, kind) -> None:
    values = np.array([0.0, -0.0, np.finfo(dtype).max, np.finfo(dtype).smallest_subnormal, value], dtype)
    assert nonfinite(values, name) == kind


@pytest.mark.parametrize(("bits", "kind"), [(0x7FC0, "NaN"), (0xFFC1, "NaN"), (0x7F80, "Inf"), (0xFF80, "Inf"), (0x7F7F, None)])
def test_nonfinite_in_bfloat16_bit_patterns(bits, kind) -> None:
    assert nonfinite(np.array([0x3F80, bits], np.uint16), "BF16") == kind


def test_nan_is_named_before_inf() -> None:
    assert nonfinite(np.array([np.inf, 1.0, np.nan], np.float32), "F32") == "NaN"


def test_nonfinite_reads_any_view_of_the_bytes() -> None:
    values = np.array([1.0, np.inf], np.float32)
    assert nonfinite(values.view(np.int32), "F32") == "Inf"


def test_scan_values_names_each_tensor_in_name_order(tmp_path) -> None:
    t = lora_tensors()
    key_v = tensor_key(1, "v_proj", "A")
    t[key_v] = t[key_v].astype(np.float16)
    t[key_v][3, 2] = np.inf
    t[Q_B][0, 1] = np.nan
    t[tensor_key(0, "v_proj", "A")] = BF16(np.full((4, 16), 0x7FC0, np.uint16))
    header = header_of(t, tmp_path)
    assert scan_values(tmp_path / "w.safetensors", header) == [
        f"tensor {Q_B!r} contains NaN values",
        f"tensor {tensor_key(0, 'v_proj', 'A')!r} contains NaN values",
        f"tensor {key_v!r} contains Inf values",
    ]


def test_scan_values_reads_in_chunks_to_the_last_element(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tensors, "SCAN_ELEMENTS", 7)
    t = lora_tensors()
    t[Q_A][3, 15] = -np.inf  # the very last element of a 64-element tensor
    assert scan_values(tmp_path / "w.safetensors", header_of(t, tmp_path)) == [f"tensor {Q_A!r} contains Inf values"]


def test_scan_values_skips_what_is_not_a_float(tmp_path) -> None:
    t = {**lora_tensors(), Q_A: np.full((4, 16), -1, np.int32)}  # all bits set: a NaN if read as F32
    assert scan_values(tmp_path / "w.safetensors", header_of(t, tmp_path)) == []

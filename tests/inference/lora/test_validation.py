"""The engine wires the adapter rules (protocol.adapter_format, whose own tests cover every rule):
load_adapter refuses with an AdapterError naming the adapter and giving the rules' first reason,
checks every value it reads (and again in the serving dtype), logs and keeps the warning of an
adapter accepted with an unverifiable base name, and refuses it under strict_base_match. One
good PEFT adapter is saved once; each test breaks a copy of it. Nothing is ever unpickled."""

from __future__ import annotations

import dataclasses
import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.lora.adapter import load_adapter
from inference.lora.errors import AdapterError
from inference.lora.validation import base_shapes, module_shapes
from protocol.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from tests.inference.lora.peft_adapters import SERVED_NAME, tiny_config, write_peft_adapter

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
UP_B = "base_model.model.model.layers.2.mlp.up_proj.lora_B.weight"


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """r=4 on all seven projections of every layer of the tiny base, written by PEFT."""
    path = tmp_path_factory.mktemp("good")
    write_peft_adapter(path, r=4, lora_alpha=8, target_modules="all-linear")
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


def test_a_good_adapter_loads(adapter_dir: Path) -> None:
    adapter = load(adapter_dir)
    assert len(adapter.weights) == 3 * 7 and adapter.warnings == ()


def test_adapter_error_survives_pickling() -> None:
    err = pickle.loads(pickle.dumps(AdapterError("x", "why")))
    assert (err.adapter, err.reason, str(err)) == ("x", "why", "adapter 'x': why")


def test_the_base_is_described_by_the_served_checkpoint() -> None:
    config = tiny_config()
    shapes = base_shapes(config, max_lora_rank=32)
    assert (shapes.name, shapes.num_hidden_layers, shapes.max_lora_rank) == (SERVED_NAME, 3, 32)
    assert module_shapes(config) == shapes.module_shapes()
    assert module_shapes(config)["k_proj"] == (config.hidden_size, config.kv_size)
    assert module_shapes(config)["o_proj"] == (config.q_size, config.hidden_size)


# --- each step's reason reaches the caller --------------------------------------------------------


class _WouldRun:
    """Unpickling this creates `marker`: proof that nobody unpickled the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_pickle_beside_the_adapter_is_refused_unopened(adapter_dir: Path, tmp_path: Path) -> None:
    (adapter_dir / "checkpoint-10").mkdir()
    (adapter_dir / "checkpoint-10" / "optimizer.pt").write_bytes(pickle.dumps(_WouldRun(tmp_path / "ran")))
    assert refused(adapter_dir) == (
        "checkpoint-10/optimizer.pt is a pickle file (.pt); pickles are never opened, only safetensors are "
        "accepted: it is not part of the adapter (optimizer, scheduler or other training state?): leave it out"
    )
    assert not (tmp_path / "ran").exists()


def test_other_files_beside_the_adapter_are_left_alone(adapter_dir: Path) -> None:
    (adapter_dir / "README.md").write_text("# card")
    (adapter_dir / "events.out.tfevents").write_bytes(b"\0\1")
    assert len(load(adapter_dir).weights) == 21


def test_not_a_directory(tmp_path: Path) -> None:
    assert refused(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'} is not a directory"


def test_missing_safetensors(adapter_dir: Path) -> None:
    (adapter_dir / WEIGHTS_FILE).unlink()
    assert refused(adapter_dir) == "missing adapter_model.safetensors"


def test_the_rank_limit_is_max_lora_rank(adapter_dir: Path) -> None:
    assert refused(adapter_dir, max_lora_rank=3) == "r = 4 is above max_lora_rank = 3"
    assert len(load(adapter_dir, max_lora_rank=4).weights) == 21


def test_a_target_the_base_does_not_have(adapter_dir: Path) -> None:
    edit_config(adapter_dir, target_modules=["q_proj", "c_attn"])
    assert refused(adapter_dir).startswith("target_modules entry 'c_attn' matches no module of the base model")


def test_shapes_are_the_served_checkpoints(adapter_dir: Path) -> None:
    base = dataclasses.replace(tiny_config(), intermediate_size=128)  # the adapter saw 192
    assert refused(adapter_dir, base=base) == (
        "tensor 'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' has shape [4, 192]; "
        "model.layers.0.mlp.down_proj of the base model needs [4, 128] [r=4, in_features=128]"
    )


def test_a_truncated_safetensors(adapter_dir: Path) -> None:
    path = adapter_dir / WEIGHTS_FILE
    path.write_bytes(path.read_bytes()[:-100])
    assert refused(adapter_dir).startswith("adapter_model.safetensors is corrupt or truncated: ")


def test_the_first_of_several_reasons(adapter_dir: Path) -> None:
    edit_config(adapter_dir, use_dora=True, bias="all", base_model_name_or_path="meta-llama/Llama-3.1-8B")
    edit_tensors(adapter_dir, lambda t: t.__setitem__(Q_A, torch.full((4, 64), float("nan"))))
    assert refused(adapter_dir) == "use_dora is true; DoRA adapters are not supported"
    edit_config(adapter_dir, use_dora=False, bias="none")
    assert refused(adapter_dir) == (
        f"base_model_name_or_path 'meta-llama/Llama-3.1-8B' names a different model than the served base {SERVED_NAME!r}"
    )
    edit_config(adapter_dir, base_model_name_or_path="HuggingFaceTB/SmolLM2-135M")
    assert refused(adapter_dir) == f"tensor {Q_A!r} contains NaN values"


# --- the values the engine reads ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("value", "word"), [(float("nan"), "NaN"), (float("inf"), "Inf"), (float("-inf"), "Inf")])
def test_non_finite_weights_as_stored(adapter_dir: Path, dtype, value: float, word: str) -> None:
    def poison(tensors):
        for key in tensors:
            tensors[key] = tensors[key].to(dtype)
        tensors[UP_B][3, 1] = value

    edit_tensors(adapter_dir, poison)
    assert refused(adapter_dir) == f"tensor {UP_B!r} contains {word} values"


def test_weights_that_overflow_the_serving_dtype(adapter_dir: Path) -> None:
    edit_tensors(adapter_dir, lambda t: t[Q_B].__setitem__((0, 0), 1e38))
    edit_config(adapter_dir, lora_alpha=400)  # scale 100: 1e40 overflows float32
    assert refused(adapter_dir) == f"tensor '{Q_B} (scaled by 100, as torch.float32)' contains Inf values"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_scaled_in_place_past_their_own_dtype_are_refused(adapter_dir: Path, dtype) -> None:
    """Stored in the serving dtype, B is scaled where it lies: a product past that dtype's
    largest value is Inf and refused; one just below it loads."""
    big = torch.finfo(dtype).max / 50

    def store(value):
        def edit(tensors):
            for key in tensors:
                tensors[key] = tensors[key].to(dtype)
            tensors[Q_B][0, 0] = value
        return edit

    edit_config(adapter_dir, lora_alpha=400)  # scale 100
    edit_tensors(adapter_dir, store(big))
    assert refused(adapter_dir, dtype=dtype) == f"tensor '{Q_B} (scaled by 100, as {dtype})' contains Inf values"
    edit_tensors(adapter_dir, store(big / 4))
    scaled = load(adapter_dir, dtype=dtype).get(0, "q_proj").b[0, 0].item()
    assert scaled == pytest.approx(float(torch.tensor(big / 4, dtype=dtype)) * 100, rel=1e-2)


def test_weights_that_overflow_half_precision(adapter_dir: Path) -> None:
    edit_tensors(adapter_dir, lambda t: t[Q_A].__setitem__((0, 0), 1e5))  # float16 tops out at 65504
    assert refused(adapter_dir, dtype=torch.float16) == f"tensor '{Q_A} (as torch.float16)' contains Inf values"
    assert load(adapter_dir, dtype=torch.bfloat16).get(0, "q_proj").a[0, 0].item() == pytest.approx(1e5, rel=1e-2)


# --- base_model_name_or_path --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("claimed", "why"),
    [
        ("/home/me/checkpoints/base", "'/home/me/checkpoints/base' is not a recognisable model id"),
        (None, "is missing"),
    ],
)
def test_an_unrecognisable_base_is_logged_and_kept_or_refused_when_strict(
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
        f"base_model_name_or_path {why}; strict_base_match requires it to name the served base {SERVED_NAME!r}"
    )


def test_the_served_model_named_passes_strict(adapter_dir: Path) -> None:
    assert load(adapter_dir, strict_base_match=True).warnings == ()  # PEFT recorded SmolLM2-135M-Instruct

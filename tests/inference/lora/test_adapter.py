"""load_adapter against PEFT itself: adapters written by PEFT's save_pretrained on a tiny Llama
must parse into A/B (scale folded into B) that reproduce PEFT's own LoRA delta, module by
module, for every way PEFT lets target modules, ranks and scales be chosen."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from inference.lora.adapter import LoRAAdapter, load_adapter
from protocol.adapter_format import SUPPORTED_MODULES, WEIGHTS_FILE
from tests.inference.lora.peft_adapters import (
    BASE_MODEL_ID,
    peft_lora_module,
    tiny_config,
    write_peft_adapter,
)

ALL = list(SUPPORTED_MODULES)
CASES = {
    "all_modules_r8": dict(r=8, lora_alpha=16, target_modules=ALL),
    "q_v_r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "regex_k_down_r2": dict(r=2, lora_alpha=3, target_modules=r".*\.(k_proj|down_proj)"),
    "rslora_r16": dict(
        r=16, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "gate_proj", "up_proj"]
    ),
    "layers_0_2": dict(
        r=4,
        lora_alpha=4,
        target_modules=["q_proj", "down_proj"],
        layers_to_transform=[0, 2],
        layers_pattern="layers",
    ),
    "layer_1_int": dict(r=1, lora_alpha=2, target_modules=["v_proj"], layers_to_transform=1),
    "rank_alpha_pattern": dict(
        r=4,
        lora_alpha=8,
        target_modules=ALL,
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 12},
        alpha_pattern={"v_proj": 32},
    ),
    "rslora_rank_pattern": dict(
        r=8,
        lora_alpha=6,
        use_rslora=True,
        target_modules=["q_proj", "up_proj"],
        rank_pattern={"up_proj": 3},
    ),
    "all_linear": dict(r=2, lora_alpha=2, target_modules="all-linear"),
    "exclude_layer_0": dict(
        r=2,
        lora_alpha=5,
        target_modules=["k_proj", "gate_proj"],
        exclude_modules=r"model\.layers\.0\..*",
    ),
}
NUM_LAYERS = 3


def assert_matches_peft(ours: LoRAAdapter, peft_model, skipped: set[int] = frozenset()) -> int:
    """Every (layer, module): ours adapted iff PEFT wrapped it (minus `skipped` layers), with
    scale·B·A == PEFT's get_delta_weight and x·Aᵀ·Bᵀ == PEFT's LoRA output. Returns the count."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for layer in range(NUM_LAYERS):
        for module in SUPPORTED_MODULES:
            peft_mod = peft_lora_module(peft_model, layer, module)
            ours_w = ours.get(layer, module)
            if peft_mod is None or layer in skipped:
                assert ours_w is None, (layer, module)
                continue
            assert ours_w is not None, (layer, module)
            assert ours_w.rank == peft_mod.r["default"]
            assert ours_w.scale == pytest.approx(peft_mod.scaling["default"], rel=1e-12)
            with torch.no_grad():
                delta = peft_mod.get_delta_weight("default")  # [out, in]
                torch.testing.assert_close(ours_w.b @ ours_w.a, delta, rtol=1e-5, atol=1e-6)
                x = torch.randn(5, ours_w.a.shape[1], generator=g)  # [T, in]
                peft_out = peft_mod(x) - peft_mod.base_layer(x)  # PEFT's LoRA contribution [T, out]
                torch.testing.assert_close(
                    x @ ours_w.a.T @ ours_w.b.T, peft_out, rtol=1e-5, atol=1e-5
                )
            checked += 1
    return checked


@pytest.mark.parametrize("case", list(CASES))
def test_matches_peft(case: str, tmp_path: Path) -> None:
    kwargs = CASES[case]
    peft_model = write_peft_adapter(tmp_path, **kwargs)
    ours = load_adapter(tmp_path, case, tiny_config(), max_lora_rank=16)
    checked = assert_matches_peft(ours, peft_model)
    assert checked == len(ours.weights) > 0

    r, alpha = kwargs["r"], kwargs["lora_alpha"]
    assert ours.name == case and ours.config_rank == r and ours.alpha == alpha
    assert ours.use_rslora is kwargs.get("use_rslora", False)
    assert ours.scale == pytest.approx(alpha / math.sqrt(r) if ours.use_rslora else alpha / r)
    assert ours.rank == max(w.rank for w in ours.weights.values())
    assert ours.target_modules == {m for _, m in ours.weights}
    assert ours.nbytes == sum(4 * (w.a.numel() + w.b.numel()) for w in ours.weights.values())
    assert ours.num_layers == NUM_LAYERS and ours.dtype == torch.float32
    assert ours.base_model_name_or_path == BASE_MODEL_ID and ours.warnings == ()
    assert ours.source == tmp_path and len(ours.id) == 64


def test_rank_pattern_sets_per_module_rank_and_scale(tmp_path: Path) -> None:
    write_peft_adapter(tmp_path, **CASES["rank_alpha_pattern"])
    ours = load_adapter(tmp_path, "patterns", tiny_config(), max_lora_rank=16)
    assert ours.get(0, "q_proj").rank == 2 and ours.get(0, "q_proj").scale == 8 / 2
    assert ours.get(1, "down_proj").rank == 12 and ours.get(0, "down_proj").rank == 4
    assert ours.get(2, "v_proj").scale == 32 / 4 and ours.get(2, "k_proj").scale == 8 / 4
    assert ours.rank == 12 and ours.config_rank == 4
    assert ours.layers("down_proj") == [0, 1, 2]


def test_adapter_that_skips_layers_by_leaving_out_their_tensors(tmp_path: Path) -> None:
    peft_model = write_peft_adapter(tmp_path, r=4, lora_alpha=8, target_modules=ALL)
    path = tmp_path / WEIGHTS_FILE
    tensors = {k: t for k, t in load_file(path).items() if ".layers.1." not in k}
    save_file(tensors, path, metadata={"format": "pt"})
    ours = load_adapter(tmp_path, "skips", tiny_config(), max_lora_rank=8)
    assert assert_matches_peft(ours, peft_model, skipped={1}) == 2 * len(ALL)
    assert ours.layers("q_proj") == [0, 2]


def test_adapter_name_infix_in_tensor_names_is_tolerated(tmp_path: Path) -> None:
    peft_model = write_peft_adapter(
        tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]
    )
    path = tmp_path / WEIGHTS_FILE
    renamed = {
        k.replace(".lora_A.weight", ".lora_A.default.weight").replace(
            ".lora_B.weight", ".lora_B.default.weight"
        ): t
        for k, t in load_file(path).items()
    }
    save_file(renamed, path)
    ours = load_adapter(tmp_path, "infix", tiny_config(), max_lora_rank=8)
    assert assert_matches_peft(ours, peft_model) == 2 * NUM_LAYERS


def test_id_is_the_content_hash(tmp_path: Path) -> None:
    write_peft_adapter(tmp_path / "a", r=4, lora_alpha=8, target_modules=["q_proj"])
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    base = tiny_config()
    a = load_adapter(tmp_path / "a", "a", base, max_lora_rank=8)
    assert load_adapter(tmp_path / "a", "a", base, max_lora_rank=8).id == a.id
    assert load_adapter(tmp_path / "copy", "renamed", base, max_lora_rank=8).id == a.id
    assert load_adapter(tmp_path / "a", "a", base, max_lora_rank=8, dtype=torch.bfloat16).id == a.id

    shutil.copytree(tmp_path / "a", tmp_path / "alpha")  # same weights, another lora_alpha
    config = json.loads((tmp_path / "alpha" / "adapter_config.json").read_text())
    config["lora_alpha"] = 9
    (tmp_path / "alpha" / "adapter_config.json").write_text(json.dumps(config))
    assert load_adapter(tmp_path / "alpha", "a", base, max_lora_rank=8).id != a.id

    shutil.copytree(tmp_path / "a", tmp_path / "weights")  # same config, one value changed
    path = tmp_path / "weights" / WEIGHTS_FILE
    tensors = load_file(path)
    key = sorted(tensors)[0]
    tensors[key][0, 0] += 1.0
    save_file(tensors, path)
    changed = load_adapter(tmp_path / "weights", "a", base, max_lora_rank=8)
    assert changed.id != a.id
    assert not torch.equal(changed.get(0, "q_proj").a, a.get(0, "q_proj").a)


def test_dtype_and_immutability(tmp_path: Path) -> None:
    write_peft_adapter(tmp_path, r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    fp32 = load_adapter(tmp_path, "x", tiny_config(), max_lora_rank=8)
    bf16 = load_adapter(tmp_path, "x", tiny_config(), max_lora_rank=8, dtype=torch.bfloat16)
    w32, w16 = fp32.get(2, "down_proj"), bf16.get(2, "down_proj")
    assert w16.a.dtype == w16.b.dtype == torch.bfloat16 and bf16.nbytes * 2 == fp32.nbytes
    torch.testing.assert_close(w16.b.float(), w32.b, rtol=1e-2, atol=1e-3)
    assert w32.a.shape == (4, 192) and w32.b.shape == (64, 4)  # [r, intermediate], [hidden, r]
    with pytest.raises(TypeError):
        fp32.weights[(0, "k_proj")] = w32  # read-only mapping
    with pytest.raises(AttributeError):
        fp32.id = "other"  # frozen


def test_bad_arguments_are_value_errors(tmp_path: Path) -> None:
    write_peft_adapter(tmp_path, r=2, lora_alpha=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="max_lora_rank must be a positive integer, got 0"):
        load_adapter(tmp_path, "x", tiny_config(), max_lora_rank=0)
    with pytest.raises(ValueError, match="dtype must be a floating torch.dtype"):
        load_adapter(tmp_path, "x", tiny_config(), max_lora_rank=8, dtype=torch.int8)

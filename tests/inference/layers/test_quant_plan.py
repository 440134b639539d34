"""What multiplies quantised weights, chosen at start-up (inference/layers/quant_plan.py): forced
by the flag, raced on the model's first layer under auto without repacking the model's weights,
torch wherever the fused kernel cannot serve, and every weight then runs on the choice."""

from __future__ import annotations

import json

import pytest
import torch

from inference.config import QUANT_KERNEL_CHOICES, ConfigError, EngineConfig
from inference.layers import quant_plan
from inference.layers.linear import apply_plan
from inference.layers.matmul_plan import native_plan
from inference.layers.quant_plan import with_quant_kernel
from inference.layers.quantized import packed_weights
from inference.models.loader import load_model
from kernels import cpu_fused
from tests.inference.models.tiny_llama import write_gguf, write_tiny_checkpoint

PLAN = native_plan(torch.float32)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant_plan")
    write_gguf(write_tiny_checkpoint(root / "base"), root / "tiny.gguf", matrix_type="Q4_1")
    return root / "tiny.gguf"


def int4_model(path):
    return load_model(path, dtype=torch.float32, progress=False, weights_dtype="int4")


@pytest.fixture
def fused_built():
    if cpu_fused.fused_op() is None:
        pytest.skip(f"fused kernels not built here: {cpu_fused.unavailable_reason()}")


def test_the_config_and_its_variable_know_every_quant_kernel():
    assert QUANT_KERNEL_CHOICES == ("auto", "fused", "torch") and EngineConfig().quant_kernel == "auto"
    assert EngineConfig.from_env({"INFERENCE_QUANT_KERNEL": "torch"}).quant_kernel == "torch"
    with pytest.raises(ConfigError, match="INFERENCE_QUANT_KERNEL: expected one of auto, fused, torch"):
        EngineConfig.from_env({"INFERENCE_QUANT_KERNEL": "int8"})
    with pytest.raises(ValueError, match="quant kernel must be one of auto, fused, torch"):
        with_quant_kernel(PLAN, "fastest", torch.nn.Linear(2, 2), torch.float32)


def test_auto_races_the_first_layer_and_leaves_the_models_weights_as_they_were(gguf, fused_built):
    model = int4_model(gguf)
    auto = with_quant_kernel(PLAN, "auto", model, torch.float32)
    timed = auto.timings["quant_kernel"]
    assert set(timed) == {"torch", "fused"}
    fused_wins = timed["fused"] < quant_plan.SWITCH_FACTOR * timed["torch"]
    assert auto.quant_kernel == ("fused" if fused_wins else "torch")
    assert json.loads(json.dumps(auto.describe()))["quant_kernel"] == auto.quant_kernel
    # the race repacked copies: every weight of the model can still take either kernel
    assert all(w.can_use("fused") and w.kernel == "fused" for w in packed_weights(model))


@pytest.mark.parametrize("kernel", ["fused", "torch"])
def test_a_forced_kernel_is_taken_unraced_and_apply_plan_gives_it_to_every_weight(gguf, kernel, fused_built):
    model = int4_model(gguf)
    plan = with_quant_kernel(PLAN, kernel, model, torch.float32)
    assert plan.quant_kernel == kernel and "quant_kernel" not in plan.timings
    apply_plan(model, plan)
    weights = packed_weights(model)
    assert len(weights) == 4 * model.config.num_hidden_layers + 1  # every projection and the head
    assert {w.kernel for w in weights} == {kernel}


def test_a_model_without_quantised_weights_keeps_torch_unraced(gguf):
    dense = load_model(gguf, dtype=torch.float32, progress=False)
    for requested in ("auto", "fused"):
        plan = with_quant_kernel(PLAN, requested, dense, torch.float32)
        assert plan.quant_kernel == "torch" and "quant_kernel" not in plan.timings


def test_without_the_kernels_auto_takes_torch_and_fused_says_why(gguf, monkeypatch):
    model = int4_model(gguf)
    monkeypatch.setattr(cpu_fused, "_state", {"error": "RuntimeError: no C++ compiler (c++) on PATH"})
    assert with_quant_kernel(PLAN, "auto", model, torch.float32).quant_kernel == "torch"
    with pytest.raises(RuntimeError, match=r"quant kernel fused: cannot be built here \(RuntimeError: no C\+\+"):
        with_quant_kernel(PLAN, "fused", model, torch.float32)


def test_weights_already_repacked_for_torch_stay_on_torch(gguf, fused_built):
    model = int4_model(gguf)
    apply_plan(model, with_quant_kernel(PLAN, "torch", model, torch.float32))
    assert with_quant_kernel(PLAN, "auto", model, torch.float32).quant_kernel == "torch"
    with pytest.raises(RuntimeError, match="already packed for torch's kernel"):
        with_quant_kernel(PLAN, "fused", model, torch.float32)

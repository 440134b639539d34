"""LoRA slots in the model's projections: a slot's adapter is added per token, in fp32 or in bf16
(where a CPU without bf16 units computes the base product in fp32 and the delta joins it before
the one rounding), base-only tokens stay exactly the base projection; a cleared slot is zero."""

from __future__ import annotations

import pytest
import torch

from inference.layers.linear import apply_plan
from inference.layers.matmul_plan import FP32_UPCAST, forced_plan
from inference.lora.adapter import load_adapter
from inference.lora.slots import LoRASlots
from inference.models.llama import LlamaForCausalLM
from tests.inference.lora.peft_adapters import tiny_config, write_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("slots") / "ad"
    write_peft_adapter(path, seed=3, r=8, lora_alpha=16, target_modules=ALL)
    return path


@pytest.mark.parametrize(
    "dtype, bf16_units",
    [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
    ids=["fp32", "bf16", "bf16-fp32-path"],
)
def test_projection_adds_the_slot_adapter_per_token(adapter_dir, dtype, bf16_units):
    config = tiny_config()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(dtype)
    if not bf16_units:  # the plan of CPUs without AVX512-BF16/AMX, taken here on any CPU
        apply_plan(model, forced_plan(FP32_UPCAST, dtype))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    adapter = load_adapter(adapter_dir, "ad", config, max_lora_rank=16, dtype=dtype)
    slots = LoRASlots(model, max_loras=2, max_rank=16, dtype=dtype, device=torch.device("cpu"))
    slots.activate(1, adapter)

    proj = model.layers[1].mlp.gate_up_proj
    x = torch.randn(8, config.hidden_size).to(dtype)  # 8 rows: enough for the fp32 path
    token_slots = torch.tensor([1, 1, -1, 1, -1, -1, 1, 1])
    base = proj(x)  # no step metadata: plain linear
    adapted = proj(x, slots.batch_metadata(token_slots))

    x32 = x.float()
    gate, up = adapter.get(1, "gate_proj"), adapter.get(1, "up_proj")
    delta = torch.cat([x32 @ gate.a.float().T @ gate.b.float().T, x32 @ up.a.float().T @ up.b.float().T], dim=1)
    expected = (x32 @ proj.weight.float().T + delta * (token_slots >= 0).unsqueeze(1)).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(adapted, expected, **tol)
    assert torch.equal(adapted[token_slots < 0], base[token_slots < 0])  # base rows bit for bit
    assert (adapted[token_slots >= 0].float() - base[token_slots >= 0].float()).abs().max() > 10 * tol["atol"]


def test_every_adapted_projection_of_every_layer_gets_the_slot(adapter_dir):
    config = tiny_config()
    model = LlamaForCausalLM(config)
    adapter = load_adapter(adapter_dir, "ad", config, max_lora_rank=16)
    slots = LoRASlots(model, max_loras=2, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    assert len(slots.projections) == 4 * config.num_hidden_layers  # qkv, o, gate_up, down
    slots.activate(0, adapter)
    for layer_idx, proj in slots.projections:
        for i, name in enumerate(proj.slice_names):
            w = adapter.get(layer_idx, name)
            torch.testing.assert_close(proj.lora_a[i][0, : w.rank], w.a)
            torch.testing.assert_close(proj.lora_b[i][0, :, : w.rank], w.b)
            assert proj.lora_a[i][1].abs().sum() == 0  # the other slot stays empty


def test_deactivated_slot_is_zero_and_its_projection_skips_the_delta(adapter_dir):
    config = tiny_config()
    model = LlamaForCausalLM(config)
    adapter = load_adapter(adapter_dir, "ad", config, max_lora_rank=16)
    slots = LoRASlots(model, max_loras=2, max_rank=16, dtype=torch.float32, device=torch.device("cpu"))
    slots.activate(0, adapter)
    assert slots.ranks.tolist() == [8, 0] and all(p.adapted for _, p in slots.projections)
    slots.deactivate(0)
    assert slots.ranks.tolist() == [0, 0]
    assert all(t.abs().sum() == 0 for _, p in slots.projections for t in p.lora_a + p.lora_b)
    assert not any(p.adapted for _, p in slots.projections)
    assert slots.batch_metadata(torch.tensor([-1, -1])) is None  # base-only step: no grouping

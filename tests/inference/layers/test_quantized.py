"""Weight-only quantised projections: what the kernels multiply by is the weight the GGUF blocks
(or the requantised dense weight) describe, within bf16 rounding; a LoRA delta still adds on top.

Tolerances: the kernels take bf16 activations and scales, so a product is compared with the
float32 product of the same (dequantised) weight at ~1% of its scale; the int4 weight read from
Q4_0/Q4_1 blocks equals gguf's own dequantisation to bf16 precision (scale and zero are bf16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from inference.layers.lora_linear import LoRALinear
from inference.layers.quantized import Int4Weight, Int8Weight
from inference.models.gguf_quants import int4_groups
from kernels.metadata import build_lora_metadata


def weights(out: int, inp: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal((out, inp)) * 0.05).astype(np.float32)


def assert_close_product(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= 0.01 * scale, "product off by more than 1%"


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_int4_from_gguf_blocks_is_the_blocks_weight(qtype):
    w = weights(96, 160)  # 5 blocks a row
    blocks = quantize(w, qtype)  # [96, 5 · block bytes] uint8, as a GGUF file stores them
    want = torch.from_numpy(dequantize(blocks, qtype).reshape(96, 160))
    packed = Int4Weight(*int4_groups(blocks, qtype, 96, 160))
    got = packed.dequantize()
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()
    x = torch.randn(3, 160)
    assert_close_product(packed.linear(x), x @ want.T)
    assert packed.linear(x).dtype == torch.float32  # the caller's dtype comes back
    assert packed.linear(x.bfloat16()).dtype == torch.bfloat16


def test_a_hand_made_q4_1_block_reads_low_nibbles_first():
    # one block: d = 0.5, m = -1; byte j holds q_j in its low nibble and q_{16+j} in its high one
    d, m = np.float16(0.5), np.float16(-1.0)
    q = np.array([j for j in range(16)] + [15 - j for j in range(16)], dtype=np.uint8)
    qs = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), qs])
    rows = np.tile(block, (16, 1))  # the kernel packs 16 output rows at a time
    packed = Int4Weight(*int4_groups(rows, GGMLQuantizationType.Q4_1, 16, 32))
    expected = 0.5 * torch.tensor(q, dtype=torch.float32) - 1.0
    assert torch.equal(packed.dequantize()[0], expected)


def test_int8_from_a_q8_0_tensor_is_within_half_a_step():
    w = weights(64, 96)
    deq = torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))
    packed = Int8Weight.quantize(deq.reshape(64, 96))
    step = deq.reshape(64, 96).abs().amax(dim=1, keepdim=True) / 127  # per output row
    assert ((packed.dequantize() - deq.reshape(64, 96)).abs() <= step * 0.51).all()
    x = torch.randn(5, 96)
    assert_close_product(packed.linear(x), x @ deq.reshape(64, 96).T)


def test_int4_requantised_from_dense_is_within_half_a_step():
    w = torch.from_numpy(weights(32, 64))
    packed = Int4Weight.quantize(w)
    groups = w.reshape(32, 2, 32)
    step = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, dim=1) / 15  # [32, 64]
    assert ((packed.dequantize() - w).abs() <= step * 0.5 + 0.01 * w.abs().max()).all()


def test_sizes_are_a_half_and_a_quarter_of_bf16_or_less():
    w = torch.from_numpy(weights(64, 128))
    dense = w.bfloat16().nbytes
    assert Int8Weight.quantize(w).nbytes <= 0.55 * dense
    assert Int4Weight.quantize(w).nbytes <= 0.35 * dense


def test_a_lora_delta_adds_to_a_quantised_base():
    torch.manual_seed(0)
    layer = LoRALinear(64, [32, 32], slice_names=("gate_proj", "up_proj"))
    layer.weight.data = torch.randn(64, 64) * 0.05
    dense = layer.weight.data.clone()
    layer.create_slots(max_loras=2, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    a, b = torch.randn(4, 64) * 0.1, torch.randn(32, 4) * 0.1
    layer.set_slot(1, [(a, b), None])  # gate adapted in slot 1, up not
    layer.packed = Int8Weight.quantize(dense)
    layer.weight.data = torch.empty(0, 64)  # freed, as the loader does
    x = torch.randn(3, 64)
    slots = torch.tensor([1, -1, 1])  # the middle token is base-only
    meta = build_lora_metadata(slots, torch.tensor([0, 4]))  # slot ranks
    want = x @ layer.packed.dequantize().T
    delta = (x @ a.T) @ b.T
    want[[0, 2], :32] += delta[[0, 2]]
    assert_close_product(layer(x, meta), want)

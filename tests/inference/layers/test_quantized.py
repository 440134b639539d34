"""Weight-only quantised projections, under each kernel (fused and torch's): what the kernels
multiply by is the weight the GGUF blocks (or the requantised dense weight) describe; a LoRA
delta still adds on top; repacking for torch's kernel keeps the weight and cannot be undone.

Tolerances: torch's kernels take bf16 activations and scales, the fused ones int8 activations per
group of 32 (~0.5% of a product), so a product is compared with the float32 product of the same
(dequantised) weight at ~1% of its scale; the int4 weight read from Q4_0/Q4_1 blocks equals
gguf's own dequantisation exactly under the fused kernel (fp16 scales, as the file's) and to
bf16 precision under torch's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from inference.layers.lora_linear import LoRALinear
from inference.layers.quantized import (
    FUSED_KERNEL,
    QUANT_KERNELS,
    TORCH_KERNEL,
    Int4Weight,
    Int8Weight,
    pack_nibbles,
    unpack_nibbles,
)
from inference.models.gguf_quants import int4_groups
from kernels import cpu_fused
from kernels.metadata import build_lora_metadata


def weights(out: int, inp: int, seed: int = 0) -> np.ndarray:
    g = np.random.default_rng(seed)
    return (g.standard_normal((out, inp)) * 0.05).astype(np.float32)


@pytest.fixture(params=QUANT_KERNELS)
def kernel(request) -> str:
    if request.param == FUSED_KERNEL and cpu_fused.fused_op() is None:
        pytest.skip(f"fused kernels not built here: {cpu_fused.unavailable_reason()}")
    return request.param


def on(weight, kernel: str):
    weight.use_kernel(kernel)
    return weight


def assert_close_product(got: torch.Tensor, want: torch.Tensor, kernel: str) -> None:
    # the fused kernel's int8 activations: ~0.5% a product on average, its worst element ~1.5%
    share = 0.02 if kernel == FUSED_KERNEL else 0.01
    scale = want.abs().max().item()
    assert (got.float() - want).abs().max().item() <= share * scale, f"product off by more than {share:.0%}"


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_int4_from_gguf_blocks_is_the_blocks_weight(qtype, kernel):
    w = weights(96, 160)  # 5 blocks a row
    blocks = quantize(w, qtype)  # [96, 5 · block bytes] uint8, as a GGUF file stores them
    want = torch.from_numpy(dequantize(blocks, qtype).reshape(96, 160))
    packed = on(Int4Weight(*int4_groups(blocks, qtype, 96, 160)), kernel)
    got = packed.dequantize()
    if kernel == FUSED_KERNEL:  # the file's fp16 scales as they are
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * want.abs().max().item())
    assert (got - want).abs().max().item() <= 0.01 * want.abs().max().item()
    x = torch.randn(3, 160)
    assert_close_product(packed.linear(x), x @ want.T, kernel)
    assert packed.linear(x).dtype == torch.float32  # the caller's dtype comes back
    assert packed.linear(x.bfloat16()).dtype == torch.bfloat16


def test_a_hand_made_q4_1_block_reads_low_nibbles_first(kernel):
    # one block: d = 0.5, m = -1; byte j holds q_j in its low nibble and q_{16+j} in its high one
    d, m = np.float16(0.5), np.float16(-1.0)
    q = np.array([j for j in range(16)] + [15 - j for j in range(16)], dtype=np.uint8)
    qs = (q[:16] | (q[16:] << 4)).astype(np.uint8)
    block = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), qs])
    rows = np.tile(block, (16, 1))  # the kernel packs 16 output rows at a time
    packed = on(Int4Weight(*int4_groups(rows, GGMLQuantizationType.Q4_1, 16, 32)), kernel)
    expected = 0.5 * torch.tensor(q, dtype=torch.float32) - 1.0
    assert torch.equal(packed.dequantize()[0], expected)


def test_int8_from_a_q8_0_tensor_is_within_half_a_step(kernel):
    w = weights(64, 96)
    deq = torch.from_numpy(dequantize(quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0))
    packed = on(Int8Weight.quantize(deq.reshape(64, 96)), kernel)
    step = deq.reshape(64, 96).abs().amax(dim=1, keepdim=True) / 127  # per output row
    assert ((packed.dequantize() - deq.reshape(64, 96)).abs() <= step * 0.51).all()
    x = torch.randn(5, 96)
    assert_close_product(packed.linear(x), x @ deq.reshape(64, 96).T, kernel)


def test_int4_requantised_from_dense_is_within_half_a_step(kernel):
    w = torch.from_numpy(weights(32, 64))
    packed = on(Int4Weight.quantize(w), kernel)
    groups = w.reshape(32, 2, 32)
    step = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, dim=1) / 15  # [32, 64]
    assert ((packed.dequantize() - w).abs() <= step * 0.5 + 0.01 * w.abs().max()).all()


def test_sizes_are_a_half_and_a_quarter_of_bf16_or_less(kernel):
    w = torch.from_numpy(weights(64, 128))
    dense = w.bfloat16().nbytes
    assert on(Int8Weight.quantize(w), kernel).nbytes <= 0.57 * dense
    assert on(Int4Weight.quantize(w), kernel).nbytes <= 0.35 * dense


def test_repacking_for_torchs_kernel_keeps_the_weight_and_is_for_good():
    w = torch.from_numpy(weights(48, 96))
    packed = Int4Weight.quantize(w)
    if packed.kernel == FUSED_KERNEL:
        before = packed.dequantize()
        packed.use_kernel(TORCH_KERNEL)
        assert (packed.dequantize() - before).abs().max() <= 0.01 * before.abs().max()  # bf16 scales
    assert packed.kernel == TORCH_KERNEL and packed.qs is None  # one packing held, not two
    assert not packed.can_use(FUSED_KERNEL)
    with pytest.raises(ValueError, match="repacked for torch's kernel"):
        packed.use_kernel(FUSED_KERNEL)
    with pytest.raises(ValueError, match="one of fused, torch"):
        packed.use_kernel("fast")


def test_nibbles_pack_in_gguf_order_and_unpack_back():
    q = torch.arange(64, dtype=torch.uint8).reshape(1, 64) % 16
    qs = pack_nibbles(q)
    assert qs.shape == (1, 32)
    assert qs[0, 0].item() == q[0, 0].item() | (q[0, 16].item() << 4)  # weights 0 and 16 share byte 0
    assert torch.equal(unpack_nibbles(qs), q)


def test_int4_groups_beyond_fp16_are_refused():
    w = torch.from_numpy(weights(16, 32))
    w[3, 5] = 1e6
    with pytest.raises(ValueError, match="beyond fp16's range"):
        Int4Weight.quantize(w)


def test_a_lora_delta_adds_to_a_quantised_base(kernel):
    torch.manual_seed(0)
    layer = LoRALinear(64, [32, 32], slice_names=("gate_proj", "up_proj"))
    layer.weight.data = torch.randn(64, 64) * 0.05
    dense = layer.weight.data.clone()
    layer.create_slots(max_loras=2, max_rank=4, dtype=torch.float32, device=torch.device("cpu"))
    a, b = torch.randn(4, 64) * 0.1, torch.randn(32, 4) * 0.1
    layer.set_slot(1, [(a, b), None])  # gate adapted in slot 1, up not
    layer.packed = on(Int8Weight.quantize(dense), kernel)
    layer.weight.data = torch.empty(0, 64)  # freed, as the loader does
    x = torch.randn(3, 64)
    slots = torch.tensor([1, -1, 1])  # the middle token is base-only
    meta = build_lora_metadata(slots, torch.tensor([0, 4]))  # slot ranks
    want = x @ layer.packed.dequantize().T
    delta = (x @ a.T) @ b.T
    want[[0, 2], :32] += delta[[0, 2]]
    assert_close_product(layer(x, meta), want, kernel)

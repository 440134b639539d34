"""A decoder layer's small ops in one call each (kernels/csrc/layer_cpu.cpp): RMSNorm, the residual
add with the norm after it, RoPE and the MLP's silu(gate) * up give what the layers' torch code gives (in bf16 and fp16, where
torch rounds at every step, the same bits but for a rare last-bit tie that the sum of squares'
order tips; to fp32 rounding in fp32), on decode and prefill row counts and strided views; the
layers call them on the CPU; a misshapen call is a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.layers import activation, norm, rotary
from inference.layers.activation import silu_mul
from inference.layers.norm import RMSNorm
from inference.layers.rotary import apply_rope, rope_heads
from kernels import cpu_fused
from tests.kernels.test_cpu_fused import HAS_COMPILER

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 7, 300]  # a decode token, a few, a prefill chunk (split across threads)


@pytest.fixture(scope="module")
def ops():
    if cpu_fused.fused_op() is None:
        if not HAS_COMPILER:
            pytest.skip(f"no C++ compiler here: {cpu_fused.unavailable_reason()}")
        pytest.fail(f"a C++ compiler is here but the kernels did not build: {cpu_fused.unavailable_reason()}")
    return cpu_fused.layer_ops()


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:  # fused multiply-adds and the sum's order: fp32 rounding
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    ulp = torch.finfo(want.dtype).eps  # one step of the last bit, relative (two at a binade's edge)
    torch.testing.assert_close(got, want, rtol=2 * ulp, atol=0)
    assert (got != want).float().mean().item() <= 1e-3, "more than a rare last-bit tie differs"


def torch_norm(layer: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return layer.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + layer.eps)).to(x.dtype)


def norm_layer(dim: int, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> RMSNorm:
    layer = RMSNorm(dim, 1e-5)
    layer.weight.data = (torch.randn(dim, generator=torch.Generator().manual_seed(3)) + 1).to(weight_dtype or dtype)
    return layer


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_the_residual_add_are_the_torch_layers(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    layer = norm_layer(576, dtype)
    x = (torch.randn(rows, 576, generator=gen) * 4).to(dtype)
    delta = torch.randn(rows, 576, generator=gen).to(dtype)
    assert_same(layer(x), torch_norm(layer, x))
    total, normed = layer.add_and_norm(x, delta)
    assert_same(total, x + delta)
    assert_same(normed, torch_norm(layer, x + delta))


def test_an_fp32_weight_on_bf16_rows_gives_fp32_as_torch_promotes(ops):
    layer = norm_layer(64, torch.bfloat16, weight_dtype=torch.float32)
    x = torch.randn(3, 64).bfloat16()
    got = layer(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch_norm(layer, x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_rotates_the_first_heads_of_a_strided_qkv_as_apply_rope(ops, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 15, 64, generator=gen).to(dtype)  # 9 q, 3 k, 3 v heads
    cos = torch.randn(rows, 1, 64, generator=gen).to(dtype)
    sin = torch.randn(rows, 1, 64, generator=gen).to(dtype)
    got = rope_heads(qkv, cos, sin, 12)
    assert got.is_contiguous()
    assert_same(got, apply_rope(qkv[:, :12], cos, sin))
    assert rope_heads(qkv, cos, sin, 0).shape == (rows, 0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("inter", [1536, 1000 + 7])  # SmolLM2's, and one that leaves a tail of a vector
def test_silu_mul_is_torchs_activation_on_the_gate_up_product(ops, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * inter + 6, generator=gen) * 4).to(dtype)[:, 3 : 3 + 2 * inter]  # strided rows
    gate_up[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.is_contiguous() and torch.equal(got.isnan(), want.isnan())  # nan, and silu(-inf), where torch has them
    assert_same(got.nan_to_num(0), want.nan_to_num(0))
    if dtype == torch.bfloat16:  # the engine's dtype: exactly torch's bits
        assert torch.equal(got.nan_to_num(0), want.nan_to_num(0))
    assert_same(silu_mul(gate_up).nan_to_num(0), want.nan_to_num(0))  # what the MLP calls, fp16 through torch


def test_the_layers_fall_back_to_torch_ops_without_the_library(ops, monkeypatch):
    layer = norm_layer(32, torch.bfloat16)
    x, delta = torch.randn(2, 32).bfloat16(), torch.randn(2, 32).bfloat16()
    qkv, cos, sin = torch.randn(2, 6, 16).bfloat16(), torch.randn(2, 1, 16).bfloat16(), torch.randn(2, 1, 16).bfloat16()
    gate_up = torch.randn(2, 64).bfloat16()
    fused = layer(x), layer.add_and_norm(x, delta), rope_heads(qkv, cos, sin, 4), silu_mul(gate_up)
    calls = []
    monkeypatch.setattr(cpu_fused, "layer_ops", lambda: calls.append(1))  # returns None: not loaded
    assert norm.cpu_fused.layer_ops is rotary.cpu_fused.layer_ops is activation.cpu_fused.layer_ops
    unfused = layer(x), layer.add_and_norm(x, delta), rope_heads(qkv, cos, sin, 4), silu_mul(gate_up)
    assert len(calls) >= 4
    assert_same(unfused[0], fused[0])
    assert_same(unfused[1][0], fused[1][0]) and assert_same(unfused[1][1], fused[1][1])
    assert_same(unfused[2], fused[2])
    assert_same(unfused[3], fused[3])


def test_misshapen_calls_are_refused(ops):
    x, w = torch.randn(2, 64), torch.ones(64)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight must be \[64\]"):
        ops.rms_norm(x, torch.ones(32), 1e-5)
    with pytest.raises(RuntimeError, match="rms_norm: x must be a contiguous"):
        ops.rms_norm(torch.randn(64), w, 1e-5)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        ops.rms_norm(x.double(), w.double(), 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm: the added tensor must match x"):
        ops.add_rms_norm(x, torch.randn(3, 64), w, 1e-5)
    with pytest.raises(RuntimeError, match="add_rms_norm: the added tensor must match x"):
        ops.add_rms_norm(x, torch.randn(2, 64).bfloat16(), w, 1e-5)
    qkv, cs = torch.randn(2, 6, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match=r"rope: heads must be in 0\.\.6"):
        ops.rope(qkv, cs, cs, 7)
    with pytest.raises(RuntimeError, match="rope: head size must be even"):
        ops.rope(torch.randn(2, 6, 15), torch.randn(2, 1, 15), torch.randn(2, 1, 15), 2)
    with pytest.raises(RuntimeError, match="rope: cos and sin must be"):
        ops.rope(qkv, torch.randn(3, 1, 16), cs, 2)
    with pytest.raises(RuntimeError, match="rope: cos and sin must be"):
        ops.rope(qkv, cs.bfloat16(), cs, 2)
    with pytest.raises(RuntimeError, match="rope: qkv must be"):
        ops.rope(qkv.transpose(1, 2), cs, cs, 2)
    with pytest.raises(RuntimeError, match=r"silu_mul: gate_up must be \[T, 2I\]"):
        ops.silu_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match=r"silu_mul: gate_up must be \[T, 2I\]"):
        ops.silu_mul(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="silu_mul: unsupported dtype"):
        ops.silu_mul(torch.randn(2, 8).double())

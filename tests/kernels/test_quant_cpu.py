"""The fused quantised products (kernels/csrc/quant_cpu.cpp, loaded by kernels/cpu_fused.py):
q4_linear and q8_linear equal, to fp32 rounding, the products they define (activations quantised
to int8 per group of 32, integer dot products, fp32 scales); they stay within the activations'
rounding of the float product; a non-finite activation spoils only its own token's outputs; a
call with mismatched or misshapen tensors is refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from inference.layers.quantized import pack_nibbles
from inference.models.gguf_quants import int4_groups
from kernels import cpu_fused
from tests.kernels.test_cpu_fused import HAS_COMPILER


@pytest.fixture(scope="module", autouse=True)
def built():
    if cpu_fused.fused_op() is None:
        if not HAS_COMPILER:
            pytest.skip(f"no C++ compiler here: {cpu_fused.unavailable_reason()}")
        pytest.fail(f"a C++ compiler is here but the kernels did not build: {cpu_fused.unavailable_reason()}")


def q4(x, qs, scales, mins):
    return torch.ops.loraplex_cpu.q4_linear(x, qs, scales, mins)


def q8(x, qw, scales):
    return torch.ops.loraplex_cpu.q8_linear(x, qw, scales)


def quantised_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (xq [T, K/32, 32] float64 integers, d [T, K/32, 1]): the kernel's Q8 activations."""
    g = x.float().reshape(x.shape[0], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return torch.round(g * inv).double(), (amax / 127).double()


def q4_reference(x, q, scales, mins):
    """q [N, K] 0..15, scales / mins [N, K/32] -> [T, N] float64, as the kernel defines it."""
    xq, d = quantised_activations(x)  # [T, G, 32], [T, G, 1]
    qg = q.double().reshape(q.shape[0], -1, 32)  # [N, G, 32]
    dots = torch.einsum("tgi,ngi->tng", xq, qg)  # [T, N, G] exact integers
    sums = (xq * d).sum(-1)  # [T, G]: d · the group's sum of xq
    return (dots * scales.double()[None] * d[..., 0][:, None]).sum(-1) + sums @ mins.double().t()


def q8_reference(x, qw, scales):
    xq, d = quantised_activations(x)
    dots = torch.einsum("tgi,ngi->tng", xq, qw.double().reshape(qw.shape[0], -1, 32))
    return (dots * d[..., 0][:, None]).sum(-1) * scales.double()[None]


def random_q4(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01 + 1e-3).half()
    mins = (-8 * scales.float() + torch.randn(n, k // 32, generator=gen) * 1e-3).half()
    return q, scales, mins


def random_q8(n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qw = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    return qw, torch.rand(n, generator=gen) * 0.01 + 1e-4


@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 9])  # blocks of 4 tokens and their remainders
@pytest.mark.parametrize("n, k", [(7, 32), (16, 96), (33, 576)])  # odd group counts, odd rows
def test_q4_is_the_product_it_defines(tokens, n, k):
    q, scales, mins = random_q4(n, k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(1))
    got = q4(x, pack_nibbles(q), scales, mins)
    want = q4_reference(x, q, scales.float(), mins.float())
    assert got.shape == (tokens, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("tokens", [1, 4, 6])
@pytest.mark.parametrize("n, k", [(5, 32), (40, 160)])
def test_q8_is_the_product_it_defines(tokens, n, k):
    qw, scales = random_q8(n, k)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(2)) * 3
    got = q8(x, qw, scales)
    want = q8_reference(x, qw, scales)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_activations_dtype_comes_back_and_strided_inputs_are_read_right(dtype):
    q, scales, mins = random_q4(24, 64)
    wide = torch.randn(3, 128).to(dtype)
    x = wide[:, ::2]  # not contiguous
    got = q4(x, pack_nibbles(q), scales, mins)
    assert got.dtype == dtype
    want = q4_reference(x.contiguous(), q, scales.float(), mins.float())
    torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=1e-2, atol=1e-2 * want.abs().max().item())
    qw, s8 = random_q8(24, 64)
    assert q8(x, qw, s8).dtype == dtype


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_gguf_blocks_multiply_within_the_activations_rounding(qtype):
    w = (np.random.default_rng(0).standard_normal((48, 256)) * 0.05).astype(np.float32)
    blocks = quantize(w, qtype)
    dense = torch.from_numpy(dequantize(blocks, qtype).reshape(48, 256))
    q, scale, zero = int4_groups(blocks, qtype, 48, 256)  # w = (q - 8) · scale + zero
    x = torch.randn(5, 256)
    got = q4(x, pack_nibbles(q), scale.half(), (zero - 8 * scale).half())
    want = x @ dense.T
    # int8 activations: ~0.5% of a product's scale, as llama.cpp's Q8 activations
    assert (got - want).norm() <= 0.01 * want.norm()


def test_a_non_finite_activation_spoils_only_its_own_tokens_outputs():
    q, scales, mins = random_q4(16, 64)
    qw, s8 = random_q8(16, 64)
    x = torch.randn(3, 64)
    x[1, 40] = float("nan")
    x[2, 3] = float("inf")
    for got, want in [
        (q4(x, pack_nibbles(q), scales, mins), q4_reference(x[:1], q, scales.float(), mins.float())),
        (q8(x, qw, s8), q8_reference(x[:1], qw, s8)),
    ]:
        assert got[1:].isnan().all()
        torch.testing.assert_close(got[:1].double(), want, rtol=1e-5, atol=1e-6)


def test_zero_activations_and_no_tokens():
    q, scales, mins = random_q4(16, 64)
    assert torch.equal(q4(torch.zeros(2, 64), pack_nibbles(q), scales, mins), torch.zeros(2, 16))
    assert q4(torch.zeros(0, 64), pack_nibbles(q), scales, mins).shape == (0, 16)
    qw, s8 = random_q8(16, 64)
    assert torch.equal(q8(torch.zeros(1, 64), qw, s8), torch.zeros(1, 16))


def test_misshapen_calls_are_refused():
    q, scales, mins = random_q4(16, 64)
    qs = pack_nibbles(q)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="x has 32 features, the weight takes 64"):
        q4(torch.randn(2, 32), qs, scales, mins)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        q4(torch.randn(2, 48), torch.zeros(16, 24, dtype=torch.uint8), torch.zeros(16, 1).half(), torch.zeros(16, 1).half())
    with pytest.raises(RuntimeError, match="uint8"):
        q4(x, qs.to(torch.int8), scales, mins)
    with pytest.raises(RuntimeError, match="fp16"):
        q4(x, qs, scales.float(), mins)
    with pytest.raises(RuntimeError, match="fp16"):
        q4(x, qs, scales, mins[:, :1].contiguous())
    with pytest.raises(RuntimeError, match="dimensions"):
        q4(torch.randn(64), qs, scales, mins)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        q4(x.double(), qs, scales, mins)
    qw, s8 = random_q8(16, 64)
    with pytest.raises(RuntimeError, match="int8"):
        q8(x, qw.to(torch.uint8), s8)
    with pytest.raises(RuntimeError, match="fp32"):
        q8(x, qw, s8[:8].contiguous())

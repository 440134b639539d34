"""Linear's bf16 paths: a bf16 product of a few rows runs as a bf16 matmul, one of many rows on a
CPU without bf16 matmul units as fp32 slabs; either way the result is the fp32-accumulated
product rounded to bf16 once (at most 1 bf16 ulp apart). Both paths run on any CPU here: the
slab path by declaring this CPU one without bf16 units."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.layers import linear as linear_module
from inference.layers.linear import UPCAST_SLAB_ROWS, Linear, linear, upcasts_to_fp32


@pytest.fixture(params=["this cpu", "no bf16 units"])
def cpu(request, monkeypatch):
    if request.param == "no bf16 units":
        monkeypatch.setattr(linear_module, "CPU_HAS_BF16_MATMUL", False)
    return request.param


@pytest.mark.parametrize("rows", [1, 4, 5, 64, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_paths_round_like_a_bf16_matmul(cpu, rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(UPCAST_SLAB_ROWS * 2 + 77, 96, generator=g).bfloat16()  # a ragged last slab
    b = torch.randn(w.shape[0], generator=g).bfloat16() if bias else None
    out = linear(x, w, b)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    ulp = ref.abs().clamp(min=1e-3) * 2**-7
    assert ((out.float() - ref).abs() <= ulp).all()


def test_only_many_bf16_rows_without_bf16_units_are_upcast(monkeypatch):
    monkeypatch.setattr(linear_module, "CPU_HAS_BF16_MATMUL", False)
    assert upcasts_to_fp32(torch.zeros(5, 8, dtype=torch.bfloat16))
    assert not upcasts_to_fp32(torch.zeros(4, 8, dtype=torch.bfloat16))  # weight-bound: stays bf16
    assert not upcasts_to_fp32(torch.zeros(64, 8))  # fp32 is fp32
    monkeypatch.setattr(linear_module, "CPU_HAS_BF16_MATMUL", True)
    assert not upcasts_to_fp32(torch.zeros(64, 8, dtype=torch.bfloat16))


def test_module_is_its_fused_slices_back_to_back():
    layer = Linear(8, [4, 2, 2], bias=True)
    assert layer.weight.shape == (8, 8) and layer.bias.shape == (8,) and layer.out_features == 8
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    assert Linear(8, [4]).bias is None

"""Linear's bf16 paths: native bf16, fp32 slabs, an fp32 copy of the weight. Whichever the
matmul plan picks for a row count, the result is the fp32-accumulated product rounded to bf16
once (at most 1 bf16 ulp apart). Every path runs on any CPU here, forced by its plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.layers.linear import DEFAULT_PLAN, Linear, apply_plan, linear, upcasts_to_fp32
from inference.layers.matmul_plan import (
    FP32_CACHED,
    FP32_UPCAST,
    NATIVE,
    PATHS,
    UPCAST_SLAB_ROWS,
    MatmulPlan,
    forced_plan,
)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows", [1, 4, 5, 64, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_paths_round_like_a_bf16_matmul(path, rows, bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(UPCAST_SLAB_ROWS * 2 + 77, 96, generator=g).bfloat16()  # a ragged last slab
    b = torch.randn(w.shape[0], generator=g).bfloat16() if bias else None
    out = linear(x, w, b, plan=forced_plan(path, torch.bfloat16),
                 weight32=w.float() if path == FP32_CACHED else None)  # fmt: skip
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    ulp = ref.abs().clamp(min=1e-3) * 2**-7
    assert ((out.float() - ref).abs() <= ulp).all()


def test_each_row_count_takes_its_shape_classes_path():
    plan = MatmulPlan({"decode": NATIVE, "batch": FP32_UPCAST, "prefill": FP32_CACHED}, torch.float32, "forced")
    bf16 = torch.bfloat16
    assert not upcasts_to_fp32(torch.zeros(4, 8, dtype=bf16), plan)  # decode: native
    assert upcasts_to_fp32(torch.zeros(5, 8, dtype=bf16), plan)  # batch
    assert upcasts_to_fp32(torch.zeros(64, 8, dtype=bf16), plan)  # prefill
    assert not upcasts_to_fp32(torch.zeros(64, 8), plan)  # fp32 is fp32 on every path
    assert [plan.path_for(n) for n in (1, 4, 5, 63, 64, 4096)] == [NATIVE, NATIVE, FP32_UPCAST, FP32_UPCAST,
                                                                   FP32_CACHED, FP32_CACHED]  # fmt: skip


def test_apply_plan_keeps_fp32_copies_only_where_the_plan_caches():
    model = torch.nn.Sequential(Linear(8, [4]), Linear(4, [8])).to(torch.bfloat16)
    for m in model:
        torch.nn.init.normal_(m.weight)
    apply_plan(model, forced_plan(FP32_CACHED, torch.bfloat16))
    assert all(m.weight32.dtype == torch.float32 and torch.equal(m.weight32, m.weight.float()) for m in model)
    x = torch.randn(70, 8).bfloat16()
    cached = model(x)
    apply_plan(model, forced_plan(FP32_UPCAST, torch.bfloat16))
    assert all(m.weight32 is None for m in model) and torch.equal(model(x), cached)  # same fp32 math
    apply_plan(model, DEFAULT_PLAN)
    assert model.plan is DEFAULT_PLAN


def test_module_is_its_fused_slices_back_to_back():
    layer = Linear(8, [4, 2, 2], bias=True)
    assert layer.weight.shape == (8, 8) and layer.bias.shape == (8,) and layer.out_features == 8
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ layer.weight.T + layer.bias)
    assert Linear(8, [4]).bias is None

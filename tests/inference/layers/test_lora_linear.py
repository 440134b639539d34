"""LoRALinear: each token gets the delta of the adapter in its slot, slice by slice of a fused
projection; tokens without an adapter (and every token of a step without adapters) get exactly
the base product; a slice no resident adapter adapts adds nothing; a cleared slot is gone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from inference.layers.lora_linear import LoRALinear
from inference.layers.matmul_plan import FP32_CACHED, FP32_UPCAST, NATIVE, forced_plan
from kernels import cpu_fused
from kernels.metadata import build_lora_metadata

IN, SIZES, MAX_LORAS, MAX_RANK = 24, [16, 8, 8], 3, 8


def make_layer(dtype: torch.dtype, path: str = NATIVE, lora_dtype: torch.dtype | None = None) -> LoRALinear:
    torch.manual_seed(0)
    layer = LoRALinear(IN, SIZES, slice_names=("q_proj", "k_proj", "v_proj"), bias=True)
    with torch.no_grad():
        layer.weight.normal_(0, 0.2)
        layer.bias.normal_(0, 0.2)
    layer = layer.to(dtype)
    layer.set_plan(forced_plan(path, dtype))
    layer.create_slots(MAX_LORAS, MAX_RANK, lora_dtype or dtype, torch.device("cpu"))
    return layer


def random_slice(rank: int, n: int, dtype: torch.dtype, in_features: int = IN) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randn(rank, in_features) * 0.3).to(dtype), (torch.randn(n, rank) * 0.3).to(dtype)


@pytest.mark.parametrize(
    "dtype, path, lora_dtype",
    [
        (torch.float32, NATIVE, torch.float32),
        (torch.bfloat16, NATIVE, torch.bfloat16),
        (torch.bfloat16, NATIVE, torch.float32),  # bf16 base product, fp32 LoRA stacks
        (torch.bfloat16, FP32_UPCAST, torch.float32),
        (torch.bfloat16, FP32_CACHED, torch.float32),
        (torch.bfloat16, FP32_UPCAST, torch.bfloat16),  # fp32 base product, bf16 stacks
    ],
    ids=["fp32", "bf16", "bf16-fp32-lora", "bf16-fp32-upcast", "bf16-fp32-cached", "bf16-upcast-bf16-lora"],
)
@pytest.mark.parametrize("decode", [False, True], ids=["segments", "padded"])
@pytest.mark.parametrize("grouped", [False, True], ids=["scattered", "grouped"])
def test_each_token_gets_its_slots_delta_slice_by_slice(dtype, path, lora_dtype, decode, grouped):
    layer = make_layer(dtype, path, lora_dtype)
    # slot 0: rank 4 on q and v only; slot 2: rank 8 on all three; slot 1 stays empty
    slot0 = [random_slice(4, 16, dtype), None, random_slice(4, 8, dtype)]
    slot2 = [random_slice(8, n, dtype) for n in SIZES]
    layer.set_slot(0, slot0)
    layer.set_slot(2, slot2)
    token_slots = torch.tensor([2, -1, 0, 0, 2, -1, 0, 2, 2])
    if grouped:  # as the engine lays a step out: each slot's tokens one contiguous run
        token_slots = token_slots.sort(stable=True).values
    # padded_max_len 0: every segment multiplied alone; 32: all together as one padded batch
    meta = build_lora_metadata(token_slots, torch.tensor([4, 0, 8]), padded_max_len=32 if decode else 0)
    x = torch.randn(len(token_slots), IN).to(dtype)

    out = layer(x, meta)

    x32 = x.float()
    expected = x32 @ layer.weight.float().T + layer.bias.float()  # [T, 32]
    for t, slot in enumerate(token_slots.tolist()):
        weights = {0: slot0, 2: slot2}.get(slot, [None] * 3)
        for (a, b), lo, n in ((w, lo, n) for w, lo, n in zip(weights, [0, 16, 24], SIZES, strict=True) if w):
            expected[t, lo : lo + n] += x32[t] @ a.float().T @ b.float().T
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(out.float(), expected, **tol)
    base = layer(x)  # no metadata: the base product alone
    assert torch.equal(out[token_slots < 0], base[token_slots < 0])
    assert torch.equal(out[token_slots == 0, 16:24], base[token_slots == 0, 16:24])  # slot 0 skips k


@pytest.mark.parametrize("path", [FP32_UPCAST, FP32_CACHED])
def test_bf16_stacks_under_an_fp32_product_add_the_delta_as_the_native_path_does(path):
    """The plan may keep bf16 stacks under fp32 products (the fused kernel raced faster on them):
    the delta then runs on bf16 x into the rounded product, like the native path's."""
    if cpu_fused.fused_op() is None:
        pytest.skip(f"the fused kernel cannot be built here: {cpu_fused.unavailable_reason()}")
    layers = {}
    for p in (path, NATIVE):
        layer = make_layer(torch.bfloat16, p, torch.bfloat16)
        layer.set_plan(replace(forced_plan(p, torch.bfloat16), lora_dtype=torch.bfloat16, lora_kernel="fused"))
        torch.manual_seed(1)
        layer.set_slot(1, [random_slice(8, n, torch.bfloat16) for n in SIZES])
        layers[p] = layer
    x = torch.randn(5, IN).to(torch.bfloat16)
    meta = build_lora_metadata(torch.tensor([1, -1, 1, 1, -1]), torch.tensor([0, 8, 0]))
    layer = layers[path]
    out, base = layer(x, meta), layer(x)  # base: the fp32 product, rounded
    adapted = [0, 2, 3]
    expected = base.float()
    for s, (lo, n) in enumerate(zip([0, 16, 24], SIZES, strict=True)):
        a, b = layer.lora_a[s][1].float(), layer.lora_b[s][1].float()  # [8, IN], [n, 8]
        expected[adapted, lo : lo + n] += x[adapted].float() @ a.T @ b.T
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    assert torch.equal(out[[1, 4]], base[[1, 4]])  # base-only tokens: the product alone
    torch.testing.assert_close(out.float(), layers[NATIVE](x, meta).float(), rtol=2e-2, atol=2e-2)


def test_unadapted_slices_and_cleared_slots_add_nothing():
    layer = make_layer(torch.float32)
    x = torch.randn(4, IN)
    meta = build_lora_metadata(torch.tensor([0, 0, -1, 0]), torch.tensor([4, 0, 0]))
    assert not layer.adapted and torch.equal(layer(x, meta), layer(x))  # no adapter resident

    layer.set_slot(0, [None, random_slice(4, 8, torch.float32), None])  # k only
    assert layer.adapted
    out = layer(x, meta)
    assert torch.equal(out[:, :16], layer(x)[:, :16]) and torch.equal(out[:, 24:], layer(x)[:, 24:])
    assert not torch.equal(out[:, 16:24], layer(x)[:, 16:24])

    layer.clear_slot(0)
    assert not layer.adapted and torch.equal(layer(x, meta), layer(x))
    assert all(t.abs().sum() == 0 for t in layer.lora_a + layer.lora_b)
    assert layer.lora_nbytes == 4 * MAX_LORAS * MAX_RANK * (3 * IN + sum(SIZES))


def test_refilling_a_slot_replaces_the_previous_adapter_entirely():
    layer = make_layer(torch.float32)
    x = torch.randn(2, IN)
    # ranked 8 in the metadata: the torch path reads up to rank 8, so rows 2..7 must be zero again
    meta = build_lora_metadata(torch.tensor([1, 1]), torch.tensor([0, 8, 0]))
    new = [random_slice(2, 16, torch.float32), None, None]
    layer.set_slot(1, [random_slice(8, n, torch.float32) for n in SIZES])
    layer.set_slot(1, new)  # rank 2, q only: the old rank-8 rows and k/v must be gone
    expected = layer(x)
    expected[:, :16] += x @ new[0][0].T @ new[0][1].T
    torch.testing.assert_close(layer(x, meta), expected)
    assert layer.lora_a[0][1, 2:].abs().sum() == 0 and layer.lora_b[1][1].abs().sum() == 0


def test_a_slot_emptied_without_zeroing_adds_nothing_and_is_overwritten_whole_when_refilled():
    layer = make_layer(torch.float32)
    x = torch.randn(2, IN)
    layer.set_slot(1, [random_slice(8, n, torch.float32) for n in SIZES])
    layer.clear_slot(1, zero=False)  # an eviction about to refill the slot: rows left as they are
    stale = build_lora_metadata(torch.tensor([1, 1]), torch.tensor([0, 8, 0]))
    assert not layer.adapted and torch.equal(layer(x, stale), layer(x))
    layer.set_slot(0, [random_slice(4, 16, torch.float32), None, None])
    with pytest.raises(RuntimeError, match="holds an adapter"):
        layer.zero_slot(0)  # only an empty slot is zeroed: a filled one's adapter stays

    new = [random_slice(2, 16, torch.float32), None, None]
    layer.set_slot(1, new)
    meta = build_lora_metadata(torch.tensor([1, 1]), torch.tensor([4, 8, 0]))  # read up to rank 8
    expected = layer(x)
    expected[:, :16] += x @ new[0][0].T @ new[0][1].T
    torch.testing.assert_close(layer(x, meta), expected)
    assert layer.lora_a[0][1, 2:].abs().sum() == 0 and layer.lora_b[1][1].abs().sum() == 0

    layer.clear_slot(1, zero=False)
    layer.zero_slot(1)
    assert layer.lora_a[0][1].abs().sum() == 0 and layer.lora_b[0][1].abs().sum() == 0
    assert layer.lora_a[0][0].abs().sum() > 0  # slot 0 untouched


def test_wrong_slice_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="slice_names"):
        LoRALinear(IN, SIZES, slice_names=("q_proj", "k_proj"))
    layer = make_layer(torch.float32)
    with pytest.raises(ValueError, match="weights"):
        layer.set_slot(0, [None, None])


def test_with_the_fused_kernel_on_bf16_stacks_the_rows_are_paired_and_compute_the_same():
    """Where this CPU's build pairs bf16 rows (AVX512-BF16), a layer planned for the fused kernel
    keeps its stacks paired; it adds what an unpaired layer adds, bit for bit, and hands its rows
    back as copies (no view shows a paired row as [rank, in])."""
    if cpu_fused.fused_op() is None or not cpu_fused.pairs_bf16():
        pytest.skip("this CPU's build has no AVX512-BF16 path: stacks are never paired")
    layers = []
    for kernel in ("torch", "fused"):
        layer = LoRALinear(IN, SIZES, slice_names=("q_proj", "k_proj", "v_proj")).to(torch.bfloat16)
        layer.set_plan(replace(forced_plan(NATIVE, torch.bfloat16), lora_kernel=kernel))
        layer.create_slots(MAX_LORAS, MAX_RANK, torch.bfloat16, torch.device("cpu"))
        torch.manual_seed(2)
        layer.weight.data.normal_(0, 0.2)
        layer.set_slot(0, [random_slice(3, 16, torch.bfloat16), None, random_slice(3, 8, torch.bfloat16)])
        layer.set_slot(2, [random_slice(8, n, torch.bfloat16) for n in SIZES])
        layers.append(layer)
    unpaired, paired = layers
    assert paired.rows_are_views is False and unpaired.rows_are_views is True
    assert paired.lora_nbytes == unpaired.lora_nbytes
    for i in range(3):
        for slot, rank in ((0, 3), (2, 8)):
            got, want = paired.slice_rows(i, slot, rank), unpaired.slice_rows(i, slot, rank)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    x = torch.randn(9, IN).to(torch.bfloat16)
    meta = build_lora_metadata(torch.tensor([2, -1, 0, 0, 2, -1, 0, 2, 2]), torch.tensor([3, 0, 8]))
    unpaired.set_plan(replace(unpaired.plan, lora_kernel="fused"))  # the same kernel on either layout
    assert torch.equal(paired(x, meta), unpaired(x, meta))


def test_with_amx_planned_runs_of_tokens_go_on_tiles_and_add_what_the_pair_passes_add():
    """A layer planned for "amx" keeps paired stacks whose runs of >= lora_tile_rows tokens of one
    adapter multiply on AMX tiles; its output is the fused pair passes' within one bf16 rounding."""
    if cpu_fused.fused_op() is None or not cpu_fused.tiles_bf16():
        pytest.skip("no AMX-BF16 tiles here")
    outs = []
    x = torch.randn(40, 64).to(torch.bfloat16)
    meta = build_lora_metadata(torch.tensor([0] * 20 + [2, -1] * 10), torch.tensor([16, 0, 8]))
    for kernel, tile_rows in (("fused", 0), ("amx", 4)):
        layer = LoRALinear(64, [48, 32, 32], slice_names=("q_proj", "k_proj", "v_proj")).to(torch.bfloat16)
        layer.set_plan(replace(forced_plan(NATIVE, torch.bfloat16), lora_kernel=kernel, lora_tile_rows=tile_rows))
        layer.create_slots(MAX_LORAS, 16, torch.bfloat16, torch.device("cpu"))
        torch.manual_seed(3)
        layer.weight.data.normal_(0, 0.2)
        layer.set_slot(0, [random_slice(16, n, torch.bfloat16, in_features=64) for n in (48, 32, 32)])
        layer.set_slot(2, [random_slice(8, n, torch.bfloat16, in_features=64) for n in (48, 32, 32)])
        assert layer._cpu_stacks.tile_rows == tile_rows and layer._cpu_stacks.paired
        outs.append(layer(x, meta))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-2, rtol=8e-3)

"""The fused kernel's AMX tile products (kernels/csrc/lora_cpu.cpp, item_tiles): on a CPU with
AMX-BF16, runs of at least `tile_rows` tokens of one adapter multiply paired stacks on tiles.
They equal the reference and the vdpbf16ps passes on every shape the passes take (a reduction
that is no multiple of 32, widths past the last whole block of 16, odd ranks, ranks past 32),
leave other rows and slices alone, are refused where the stacks are not paired, and leave
oneDNN's own AMX products (the base model's) right around them."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels import cpu_fused, lora_ops
from kernels.metadata import build_lora_metadata
from kernels.reference import add_lora_ref


@pytest.fixture(scope="module")
def tiles():
    if cpu_fused.fused_op() is None or not cpu_fused.tiles_bf16():
        pytest.skip("no AMX-BF16 tiles here (the CPU, the OS, or no kernel build)")


def paired_stacks(in_features, widths, ranks, tile_rows, seed=0):
    """Paired bf16 CpuStacks of random adapters (zero past each slot's rank) multiplying runs of
    >= tile_rows tokens on tiles, and the plain A_s [slots, max_rank, in], B_s [slots, n_s,
    max_rank] they hold."""
    gen = torch.Generator().manual_seed(seed)
    max_rank = max(ranks) + max(ranks) % 2
    stacks, _, _ = lora_ops.cpu_stacks(len(ranks), max_rank, in_features, list(widths), torch.bfloat16, True,
                                       tile_rows)  # fmt: skip
    plain_a = [torch.zeros(len(ranks), max_rank, in_features) for _ in widths]
    plain_b = [torch.zeros(len(ranks), n, max_rank) for n in widths]
    for s, n in enumerate(widths):
        for slot, r in enumerate(ranks):
            a = (torch.randn(r, in_features, generator=gen) / in_features**0.5).bfloat16()
            b = (torch.randn(n, r, generator=gen) / r**0.5).bfloat16()
            plain_a[s][slot, :r], plain_b[s][slot, :, :r] = a.float(), b.float()
            stacks.write_slice(s, slot, a, b)
    return stacks, plain_a, plain_b, torch.tensor(ranks)


SHAPES = {  # in_features, output widths, ranks per slot
    "SmolLM2's q/k/v": (576, (576, 192, 192), (16, 8, 16)),
    "down_proj": (1536, (576,), (16, 16, 4)),
    "a reduction past 32s, widths past 16s, odd ranks": (40, (100, 17, 36), (5, 8, 3)),
    "ranks past 32": (96, (200,), (64, 33, 1)),
}
LAYOUTS = {
    "prefill chunks": [0] * 40 + [2] * 17 + [1] * 5,
    "decode, scattered": [2, -1, 0, 1, 2, 0, -1, 1, 0, 2, 1] * 3,
    "a chunk beside decode rows": [1] * 33 + [0, 2, -1, 0],
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tile_rows", [1, 8])
def test_tile_products_equal_the_reference_and_the_pair_passes(tiles, shape, layout, tile_rows):
    in_features, widths, ranks = SHAPES[shape]
    stacks, a, b, ranks = paired_stacks(in_features, widths, ranks, tile_rows)
    passes, _, _, _ = paired_stacks(in_features, widths, ranks.tolist(), 0)
    index = (0, len(widths) - 1) if len(widths) > 2 else tuple(range(len(widths)))  # a subset where there are 3
    stacks, passes = stacks.with_index(index), passes.with_index(index)
    meta = build_lora_metadata(torch.tensor(LAYOUTS[layout]), ranks)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(meta.num_tokens, in_features, generator=gen).bfloat16()
    before = torch.randn(meta.num_tokens, stacks.out_features, generator=gen).bfloat16()
    out, by_passes = before.clone(), before.clone()
    assert lora_ops.add_lora_cpu_fused(out, x, stacks, meta)
    assert lora_ops.add_lora_cpu_fused(by_passes, x, passes, meta)
    want = before.float()
    add_lora_ref(want, x.float(), [a[s] for s in index], [b[s] for s in index], meta, [stacks.offsets[s] for s in index])
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1e-2)
    # the same bf16 products summed in another order: one rounding apart at most
    torch.testing.assert_close(out, by_passes, atol=1e-2, rtol=8e-3)
    no_adapter = meta.token_slots < 0
    assert torch.equal(out[no_adapter], before[no_adapter]), "a base-only row changed"
    skipped = [c for s in set(range(len(widths))) - set(index)
               for c in range(stacks.offsets[s], stacks.offsets[s] + widths[s])]  # fmt: skip
    assert torch.equal(out[:, skipped], before[:, skipped]), "a slice outside index changed"


def test_tiles_keep_a_nan_row_to_itself(tiles):
    stacks, _, _, ranks = paired_stacks(64, (48,), (16,), 1)
    meta = build_lora_metadata(torch.zeros(16, dtype=torch.long), ranks)
    x = torch.randn(16, 64).bfloat16()
    x[3, 7] = float("nan")
    out = torch.zeros(16, 48, dtype=torch.bfloat16)
    assert lora_ops.add_lora_cpu_fused(out, x, stacks, meta)
    assert torch.isnan(out[3]).all() and not torch.isnan(out[torch.arange(16) != 3]).any()


def test_tiles_take_paired_stacks_only():
    with pytest.raises(ValueError, match="tile_rows must be 0, or >= 1 on paired stacks"):
        lora_ops.cpu_stacks(2, 16, 64, [32], torch.bfloat16, False, 8)
    with pytest.raises(ValueError, match="tile_rows must be 0, or >= 1"):
        lora_ops.cpu_stacks(2, 16, 64, [32], torch.bfloat16, True, -1)


@pytest.mark.parametrize(("paired", "tile_rows", "message"), [
    (False, 1, "tile products take paired stacks"),
    (True, -1, "tile_rows must be >= 0"),
])  # fmt: skip
def test_the_kernel_refuses_tiles_it_cannot_run(tiles, paired, tile_rows, message):
    stacks, _, _ = lora_ops.cpu_stacks(1, 4, 16, [32], torch.bfloat16, paired)
    out = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        cpu_fused.fused_op()(out, torch.randn(2, 16).bfloat16(), stacks.a_t, list(stacks.b_t), [0], [0],
                             torch.tensor([0, 1]), torch.tensor([[0, 2, 0, 4]]), paired=paired, tile_rows=tile_rows)
    assert not out.any(), "a refused call wrote to out"


def test_onednn_s_amx_products_stay_right_around_the_tiles(tiles):
    """oneDNN's bf16 GEMMs (AMX where it has them) load their own tile configuration and release
    it; ours does the same, so neither finds the other's tiles: base products and deltas
    interleaved on two threads give what each gives alone."""
    stacks, a, b, ranks = paired_stacks(576, (576, 192, 192), (16, 16, 16), 1)
    meta = build_lora_metadata(torch.zeros(64, dtype=torch.long), ranks)
    x = torch.randn(64, 576).bfloat16()
    w = (torch.randn(1536, 576) / 24).bfloat16()
    base_want = x.float() @ w.float().T
    delta_want = torch.zeros(64, 960)
    add_lora_ref(delta_want, x.float(), a, b, meta, list(stacks.offsets))
    failures = []

    def work():
        for _ in range(20):
            base = x @ w.T  # [64, 1536] on oneDNN
            out = torch.zeros(64, 960, dtype=torch.bfloat16)
            lora_ops.add_lora_cpu_fused(out, x, stacks, meta)
            if not torch.allclose(base.float(), base_want, atol=0.1, rtol=2e-2):
                failures.append("base")
            if not torch.allclose(out.float(), delta_want, atol=2e-2, rtol=1e-2):
                failures.append("delta")

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:4]


def test_a_build_without_tiles_refuses_them_rather_than_misreading():
    """On a CPU without AMX-BF16 (or an OS that withholds the tiles) a call asking for tile
    products is refused with the reason, out untouched; the plan never asks there."""
    op = cpu_fused.fused_op()
    if op is None or cpu_fused.tiles_bf16():
        pytest.skip("this build has tiles (or no kernel at all)")
    stacks, _, _ = lora_ops.cpu_stacks(1, 4, 16, [32], torch.bfloat16, cpu_fused.pairs_bf16())
    out = torch.zeros(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="tile products take paired stacks, on a CPU with AMX-BF16"):
        op(out, torch.randn(2, 16).bfloat16(), stacks.a_t, list(stacks.b_t), [0], [0], torch.tensor([0, 1]),
           torch.tensor([[0, 2, 0, 4]]), paired=stacks.paired, tile_rows=1)
    assert not out.any()

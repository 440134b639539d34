"""The CPU layout of a projection's LoRA stacks (kernels/cpu_stacks.py), unpaired and paired:
what a slot is written with is what it reads back, at any rank, zero past it; paired stacks
hold the same rows, and bad layouts are refused when the stacks are made."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_stacks import cpu_stacks

SIZES = [24, 8, 17]  # three slices, one past the last whole vector


def _adapter(rank: int, in_features: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(rank, in_features, generator=gen), torch.randn(n, rank, generator=gen)) for n in SIZES]


@pytest.mark.parametrize("paired", [False, True], ids=["unpaired", "paired"])
@pytest.mark.parametrize("rank", [1, 3, 8, 16])
def test_a_slot_reads_back_what_it_was_written_with_zero_past_its_rank(paired, rank):
    stacks, _, _ = cpu_stacks(3, 16, 40, SIZES, torch.bfloat16, paired)
    for slot in range(3):  # every slot full of another adapter first: the rewrite must clear it
        for s, (a, b) in enumerate(_adapter(16, 40, seed=slot)):
            stacks.write_slice(s, slot, a, b)
    weights = _adapter(rank, 40, seed=9)
    for s, (a, b) in enumerate(weights):
        stacks.write_slice(s, 1, a, b)
    for s, (a, b) in enumerate(weights):
        got_a, got_b = stacks.slice_rows(s, 1, rank)  # [rank, in], [n_s, rank]
        assert torch.equal(got_a, a.bfloat16()) and torch.equal(got_b, b.bfloat16())
        whole_a, whole_b = stacks.slice_rows(s, 1, 16)  # up to max_rank: zero past rank
        assert torch.equal(whole_a[:rank], got_a) and not whole_a[rank:].any()
        assert torch.equal(whole_b[:, :rank], got_b) and not whole_b[:, rank:].any()
    for s, (a, b) in enumerate(_adapter(16, 40, seed=2)):  # the other slots are untouched
        assert torch.equal(stacks.slice_rows(s, 2, 16)[0], a.bfloat16())
        assert torch.equal(stacks.slice_rows(s, 2, 16)[1], b.bfloat16())


def test_a_paired_slot_takes_rows_of_any_dtype_and_layout():
    """An fp32 adapter, and bf16 rows that are strided views at an odd offset: the same values
    land as from contiguous bf16 rows."""
    stacks, _, _ = cpu_stacks(2, 8, 40, SIZES, torch.bfloat16, paired=True)
    weights = _adapter(5, 40, seed=3)
    wide = torch.zeros(5, 81, dtype=torch.bfloat16)  # rows 81 apart
    wide[:, 1:41] = weights[0][0]
    stacks.write_slice(0, 0, wide[:, 1:41], weights[0][1])
    stacks.write_slice(1, 0, *weights[1])  # fp32
    for s in (0, 1):
        a, b = stacks.slice_rows(s, 0, 5)
        assert torch.equal(a, weights[s][0].bfloat16()) and torch.equal(b, weights[s][1].bfloat16())


def test_paired_rows_at_an_even_rank_copy_out_as_int32_pairs():
    stacks, _, _ = cpu_stacks(2, 8, 40, SIZES, torch.bfloat16, paired=True)
    for s, (a, b) in enumerate(_adapter(6, 40, seed=4)):
        stacks.write_slice(s, 1, a, b)
        a_pairs, b_pairs = stacks.slice_pairs(s, 1, 6)
        assert a_pairs.dtype == torch.int32 and (a_pairs.shape, b_pairs.shape) == ((6, 20), (SIZES[s], 3))
        assert torch.equal(a_pairs.clone(memory_format=torch.contiguous_format).view(torch.bfloat16), a.bfloat16())
        assert torch.equal(b_pairs.clone(memory_format=torch.contiguous_format).view(torch.bfloat16), b.bfloat16())
    with pytest.raises(ValueError, match="even rank"):
        stacks.slice_pairs(0, 1, 5)


def test_paired_stacks_hold_the_rows_unpaired_ones_hold():
    plain, _, _ = cpu_stacks(2, 8, 40, SIZES, torch.bfloat16)
    paired, a_views, b_views = cpu_stacks(2, 8, 40, SIZES, torch.bfloat16, paired=True)
    assert paired.paired and (paired.in_features, paired.max_rank, paired.out_features) == (40, 8, 49)
    assert paired.a_t.shape == (2, 20, 2 * 8 * 3) and [b.shape for b in paired.b_t] == [(2, 4, 2 * n) for n in SIZES]
    assert a_views[0].shape == (2, 8, 20, 2) and b_views[2].shape == (2, 17, 4, 2)
    for slot, rank in ((0, 5), (1, 8)):
        for s, (a, b) in enumerate(_adapter(rank, 40, seed=slot)):
            plain.write_slice(s, slot, a, b)
            paired.write_slice(s, slot, a, b)
    copy = paired.unpaired()
    assert not copy.paired and torch.equal(copy.a_t, plain.a_t)
    assert all(torch.equal(p, q) for p, q in zip(copy.b_t, plain.b_t, strict=True))
    assert plain.unpaired() is plain
    # rows 2k and 2k+1 of Aᵀ interleaved: the pair row the kernel loads as one vector
    assert torch.equal(paired.a_t[1, 3, 0::2], plain.a_t[1, 6]) and torch.equal(paired.a_t[1, 3, 1::2], plain.a_t[1, 7])
    for s in range(3):
        for slot, rank in ((0, 5), (1, 8)):
            got, want = paired.slice_rows(s, slot, rank), plain.slice_rows(s, slot, rank)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    # a slice left out is zero in either layout
    paired.write_slice(1, 0, None, None)
    assert not any(t.any() for t in paired.slice_rows(1, 0, 8))


@pytest.mark.parametrize(
    ("dtype", "in_features", "max_rank"),
    [(torch.float32, 40, 8), (torch.float16, 40, 8), (torch.bfloat16, 41, 8), (torch.bfloat16, 40, 7)],
)
def test_stacks_that_cannot_pair_are_refused_when_made(dtype, in_features, max_rank):
    with pytest.raises(ValueError, match="paired stacks are bf16 with even in_features and max_rank"):
        cpu_stacks(2, max_rank, in_features, SIZES, dtype, paired=True)


def _paired_or_skip(max_loras=3, max_rank=16, in_features=40):
    from kernels import cpu_fused

    if cpu_fused.fused_op() is None or not cpu_fused.pairs_bf16():
        pytest.skip("this CPU's build has no AVX512-BF16 path: stacks are never paired")
    return cpu_stacks(max_loras, max_rank, in_features, SIZES, torch.bfloat16, paired=True)[0]


@pytest.mark.parametrize("ranks", [(16, 16, 16), (3, 3, 3), (8, None, 5), (None, None, None)])
def test_a_whole_slot_written_in_one_pass_equals_slice_by_slice(ranks):
    """write_slot (the kernels' library, one call a projection) leaves every byte of the stacks
    as write_slice leaves it: over a slot full of another adapter, at odd ranks, with slices
    not adapted (None: zero), the other slots untouched."""
    one, by_slice = _paired_or_skip(), _paired_or_skip()
    for stacks in (one, by_slice):
        for slot in range(3):
            for s, (a, b) in enumerate(_adapter(16, 40, seed=slot)):
                stacks.write_slice(s, slot, a, b)
    # fp32 rows, B's a strided view: converted as write_slice converts them
    weights = [None if r is None else (a[:r], b[:, :r]) for r, (a, b) in zip(ranks, _adapter(16, 40, seed=7), strict=True)]
    one.write_slot(1, weights)
    for s, w in enumerate(weights):
        by_slice.write_slice(s, 1, *(w or (None, None)))
    assert torch.equal(one.a_t, by_slice.a_t)
    assert all(torch.equal(x, y) for x, y in zip(one.b_t, by_slice.b_t, strict=True))


@pytest.mark.parametrize("rank", [16, 6, 3])
def test_a_whole_slot_reads_out_in_one_pass_as_slice_by_slice(rank):
    stacks = _paired_or_skip()
    for slot in range(3):
        stacks.write_slot(slot, _adapter(rank if slot == 2 else 16, 40, seed=slot))
    read = stacks.read_slot(2, rank, lambda shape, dtype: torch.full(shape, 7.0, dtype=dtype))
    for s, (a, b) in enumerate(read):
        want_a, want_b = stacks.slice_rows(s, 2, rank)
        assert torch.equal(a, want_a) and torch.equal(b, want_b)
        assert (a.shape, b.shape) == ((rank, 40), (SIZES[s], rank)) and a.is_contiguous() and b.is_contiguous()


def test_a_whole_slot_takes_rows_at_an_odd_offset():
    one, by_slice = _paired_or_skip(), _paired_or_skip()
    weights = _adapter(5, 40, seed=5)
    flat = torch.zeros(1 + 5 * 40, dtype=torch.bfloat16)
    flat[1:] = weights[0][0].flatten()
    odd = flat[1:].view(5, 40)  # contiguous, 2 bytes past a 4-byte boundary
    assert odd.is_contiguous() and odd.data_ptr() % 4 == 2
    one.write_slot(0, [(odd, weights[0][1]), *weights[1:]])
    for s, (a, b) in enumerate(weights):
        by_slice.write_slice(s, 0, a, b)
    assert torch.equal(one.a_t, by_slice.a_t)


def test_a_whole_slot_write_refuses_rows_that_do_not_fit_and_writes_nothing():
    stacks = _paired_or_skip()
    before = stacks.a_t.clone(), [b.clone() for b in stacks.b_t]
    weights = _adapter(4, 40, seed=1)
    for bad, message in [
        ([*weights[:2], (weights[2][0], weights[2][1][:5])], "each B must be"),  # B of another width
        ([*weights[:2], (torch.randn(4, 38), weights[2][1])], "each A must be"),  # A of another in
        ([*weights[:2], (torch.randn(17, 40), torch.randn(17, 17))], "each A must be"),  # rank past max
    ]:
        with pytest.raises(RuntimeError, match=message):
            stacks.write_slot(0, bad)
    with pytest.raises(RuntimeError, match="slot out of range"):
        stacks.write_slot(3, weights)
    with pytest.raises(ValueError, match="weights: 2 entries for 3 slices"):
        stacks.write_slot(0, weights[:2])
    assert torch.equal(stacks.a_t, before[0]) and all(torch.equal(x, y) for x, y in zip(stacks.b_t, before[1], strict=True))

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
    a_t = stacks.slot_a_t(1, 16)  # [in, 16·S], rank-major
    assert a_t.shape == (40, 16 * 3)
    for s, (a, b) in enumerate(weights):
        assert torch.equal(a_t[:, s::3][:, :rank].T, a.bfloat16())
        assert not a_t[:, s::3][:, rank:].any()
        b_t = stacks.slot_b_t(s, 1, 16)  # [16, n_s]
        assert torch.equal(b_t[:rank].T, b.bfloat16()) and not b_t[rank:].any()
        assert torch.equal(stacks.slot_b_t(s, 1, rank), b.bfloat16().T)
    assert torch.equal(stacks.slot_a_t(1, rank), a_t[:, : rank * 3])
    # the other slots are untouched
    for s, (a, _) in enumerate(_adapter(16, 40, seed=2)):
        assert torch.equal(stacks.slot_a_t(2, 16)[:, s::3].T, a.bfloat16())


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
    # a slice left out is zero in either layout
    paired.write_slice(1, 0, None, None)
    assert not paired.slot_b_t(1, 0, 8).any() and not paired.slot_a_t(0, 8)[:, 1::3].any()


@pytest.mark.parametrize(
    ("dtype", "in_features", "max_rank"),
    [(torch.float32, 40, 8), (torch.float16, 40, 8), (torch.bfloat16, 41, 8), (torch.bfloat16, 40, 7)],
)
def test_stacks_that_cannot_pair_are_refused_when_made(dtype, in_features, max_rank):
    with pytest.raises(ValueError, match="paired stacks are bf16 with even in_features and max_rank"):
        cpu_stacks(2, max_rank, in_features, SIZES, dtype, paired=True)

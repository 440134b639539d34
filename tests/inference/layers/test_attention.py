"""paged_attention against dense causal attention over each whole sequence.

Each sequence's KV for positions < seq_len - query_len is already in the cache (written at
the slots its shuffled, non-contiguous block table says); the new tokens' k/v come with the
call. The reference attends with plain SDPA over the contiguous sequence, kv heads repeated.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from inference.layers.attention import allocate_kv_cache, paged_attention
from inference.layers.attention_metadata import build_attention_metadata

BLOCK = 16
NUM_BLOCKS = 1024


def make_batch(specs, Hq, Hkv, D, dtype, seed=0):
    """specs: [(seq_len, query_len)] -> everything a call and its reference need."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randperm(NUM_BLOCKS, generator=g).tolist()  # shuffled: tables are not contiguous
    ((k_cache, v_cache),) = allocate_kv_cache(
        num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=Hkv, head_dim=D, dtype=dtype
    )
    # finite garbage everywhere, so a slot that is not masked out would show
    k_cache.copy_(torch.randn(k_cache.shape, generator=g) * 3)
    v_cache.copy_(torch.randn(v_cache.shape, generator=g) * 3)
    seqs, tables = [], []
    for seq_len, q_len in specs:
        n = -(-seq_len // BLOCK)
        table = [blocks.pop() for _ in range(n + 1)]  # one spare block at the end
        k = torch.randn(seq_len, Hkv, D, generator=g).to(dtype)
        v = torch.randn(seq_len, Hkv, D, generator=g).to(dtype)
        q = torch.randn(q_len, Hq, D, generator=g).to(dtype)
        for p in range(seq_len - q_len):  # the cached prefix
            k_cache[table[p // BLOCK], p % BLOCK] = k[p]
            v_cache[table[p // BLOCK], p % BLOCK] = v[p]
        seqs.append((q, k, v))
        tables.append(table)
    return seqs, tables, (k_cache, v_cache)


def reference(q, k, v, scale):
    """Dense causal attention in float32: q [q, Hq, D] are the last q positions of k/v [L, Hkv, D]."""
    q_len, Hq, _ = q.shape
    L, Hkv, _ = k.shape
    rep = Hq // Hkv
    kk = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, L, D]
    vv = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)
    mask = torch.arange(L)[None, :] <= torch.arange(L - q_len, L)[:, None]  # [q, L]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), kk, vv, attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)  # [q, Hq, D]


def run_paged(specs, Hq=6, Hkv=2, D=16, dtype=torch.float32, seed=0):
    seqs, tables, cache = make_batch(specs, Hq, Hkv, D, dtype, seed)
    seq_lens = [s for s, _ in specs]
    query_lens = [q for _, q in specs]
    meta = build_attention_metadata(seq_lens, query_lens, tables, BLOCK, "cpu")
    q = torch.cat([q for q, _, _ in seqs])
    k_new = torch.cat([k[s - ql :] for (_, k, _), (s, ql) in zip(seqs, specs, strict=True)])
    v_new = torch.cat([v[s - ql :] for (_, _, v), (s, ql) in zip(seqs, specs, strict=True)])
    scale = D**-0.5
    out = paged_attention(q, k_new, v_new, cache, meta, scale)
    assert out.shape == q.shape and out.dtype == dtype
    expected = torch.cat([reference(q_, k, v, scale) for q_, k, v in seqs])
    return out, expected, meta, seqs, tables, cache


MIXED = [  # (seq_len, query_len): decode, chunk after a prefix, whole prompt, block edges
    (1, 1),  # a one-token prompt: decode-shaped
    (37, 1),
    (50, 50),
    (70, 13),  # chunked prefill: 57 cached + 13 new
    (16, 1),  # exactly one full block
    (33, 33),
    (100, 1),
    (17, 2),  # a 2-token chunk right after a block edge
    (129, 64),
]


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize(("Hq", "Hkv", "D"), [(6, 2, 16), (4, 4, 8), (9, 3, 64)])
def test_mixed_batch_matches_dense(dtype, atol, Hq, Hkv, D):
    out, expected, meta, *_ = run_paged(MIXED, Hq, Hkv, D, dtype)
    diff = (out.float() - expected).abs().max().item()
    assert diff < atol, f"max abs diff {diff:.3g}"
    assert meta.num_tokens == sum(q for _, q in MIXED)
    assert meta.num_decode_tokens == 4


def test_new_kv_written_at_their_slots():
    out, expected, meta, seqs, tables, (k_cache, v_cache) = run_paged(MIXED)
    for (seq_len, _), (_, k, v), table in zip(MIXED, seqs, tables, strict=True):
        for p in range(seq_len):  # prefix and new tokens: the cache now holds the whole sequence
            torch.testing.assert_close(k_cache[table[p // BLOCK], p % BLOCK], k[p], rtol=0, atol=0)
            torch.testing.assert_close(v_cache[table[p // BLOCK], p % BLOCK], v[p], rtol=0, atol=0)


@pytest.mark.parametrize(
    "specs",
    [
        [(5, 1), (300, 1), (2, 1), (47, 1)],  # pure decode
        [(40, 40), (25, 25)],  # pure prefill, nothing cached
        [(90, 30), (31, 31)],  # prefill chunk after a prefix first
        [(3, 3)],  # a single short prompt
    ],
)
def test_uniform_batches(specs):
    out, expected, *_ = run_paged(specs)
    assert (out - expected).abs().max().item() < 2e-6


def test_decode_rows_split_into_length_groups():
    """Very different decode lengths run as separate groups; results are unchanged."""
    specs = [(5, 1)] * 6 + [(40, 40)] + [(1500, 1)] * 6 + [(9, 1)] * 3
    out, expected, meta, *_ = run_paged(specs, seed=3)
    assert len(meta.decode_groups) >= 2
    assert sorted(i for g in meta.decode_groups for i in g.rows.tolist()) == sorted(
        i for i in range(len(out)) if not 6 <= i < 46
    )
    assert (out - expected).abs().max().item() < 2e-6


def test_metadata_slot_mapping_and_masks():
    meta = build_attention_metadata([18, 3], [2, 3], [[7, 2], [5]], block_size=16)
    # positions 16, 17 of seq 0 live in block 2; seq 1's 0..2 in block 5
    assert meta.slot_mapping.tolist() == [2 * 16 + 0, 2 * 16 + 1, 5 * 16, 5 * 16 + 1, 5 * 16 + 2]
    assert meta.query_start_loc.tolist() == [0, 2, 5]
    first, second = meta.prefills
    assert first.mask.shape == (2, 18) and first.mask[0].sum() == 17 and first.mask[1].all()
    assert second.mask is None and second.block_ids is None  # nothing cached: plain causal
    assert meta.prefill_batch is None


def test_metadata_for_the_fused_prefill_kernel_holds_every_chunk_without_masks():
    meta = build_attention_metadata([18, 1, 3], [2, 1, 3], [[7, 2], [4], [5]], block_size=16, prefill_kernel="fused")
    assert meta.prefills == [] and len(meta.decode_groups) == 1
    batch = meta.prefill_batch
    assert batch.starts.tolist() == [0, 3] and batch.query_lens.tolist() == [2, 3]
    assert batch.context_lens.tolist() == [18, 3] and batch.block_tables.tolist() == [[7, 2], [5, 0]]


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (([], [], [], 16), "seq_lens"),
        (([4], [5], [[0]], 16), r"query_lens\[0\]"),
        (([4], [0], [[0]], 16), r"query_lens\[0\]"),
        (([40, 4], [1, 1], [[0, 1], [2]], 16), r"block_tables\[0\]"),
        (([4], [1, 1], [[0]], 16), "one entry per sequence"),
        (([4], [1], [[0]], 0), "block_size"),
    ],
)
def test_metadata_rejects_bad_input(args, field):
    with pytest.raises(ValueError, match=field):
        build_attention_metadata(*args)

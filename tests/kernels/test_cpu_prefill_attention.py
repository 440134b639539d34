"""The fused paged prefill attention (kernels/csrc/prefill_attention_cpu.cpp, loaded by
kernels/cpu_fused.py): what the layers compute with it equals the torch path (one causal SDPA per
chunk) on every head layout and dtype, for chunks with and without a cached prefix, beside decode
rows, at lengths that do not fill a tile; a call that would read or write out of bounds is
refused with nothing written."""

from __future__ import annotations

import pytest
import torch

from inference.layers.attention import torch_paged_attention
from inference.layers.attention_metadata import build_attention_metadata
from kernels import cpu_fused
from tests.kernels.test_cpu_attention import (
    BLOCK,
    HEADS,
    assert_fused_equals_torch,
    assert_refused_with_nothing_written,
    step,
)
from tests.kernels.test_cpu_fused import HAS_COMPILER


@pytest.fixture(scope="module")
def op():
    if cpu_fused.fused_op() is None and not HAS_COMPILER:
        pytest.skip(f"no C++ compiler here: {cpu_fused.unavailable_reason()}")
    op = cpu_fused.prefill_attention_op()
    assert op is not None, f"a C++ compiler is here but the kernels did not build: {cpu_fused.unavailable_reason()}"
    return op


def attend(kernel, q, k, v, k_cache, v_cache, tables, seq_lens, query_lens):
    meta = build_attention_metadata(seq_lens, query_lens, tables, BLOCK, decode_kernel=kernel, prefill_kernel=kernel)
    assert (meta.prefill_batch is not None) == (kernel == "fused")
    caches = (k_cache.clone(), v_cache.clone())
    return torch_paged_attention(q, k, v, caches, meta, q.shape[-1] ** -0.5), caches


STEPS = {  # (seq_lens, query_lens)
    "one prompt": ([77], [77]),
    "prompts of 2 to 300 tokens": ([2, 17, 16, 300, 33, 129, 3], [2, 17, 16, 300, 33, 129, 3]),
    "chunks after cached prefixes": ([40, 300, 129], [7, 256, 2]),
    "prefills beside decode rows": ([40, 90, 5, 200, 31], [1, 90, 1, 12, 1]),
}


@pytest.mark.parametrize("layout", STEPS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q-{h[1]}kv-d{h[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_fused_prefill_attention_equals_the_torch_path(op, layout, heads, dtype):
    assert_fused_equals_torch(attend, heads, dtype, *STEPS[layout])


def test_a_query_never_sees_a_later_position(op):
    """Causality: changing the last token's k/v changes only the last row's output."""
    q, k, v, k_cache, v_cache, tables = step((9, 3, 64), torch.float32, [50], [50])
    before, _ = attend("fused", q, k, v, k_cache, v_cache, tables, [50], [50])
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 5.0, -5.0
    after, _ = attend("fused", q, k2, v2, k_cache, v_cache, tables, [50], [50])
    assert torch.equal(after[:-1], before[:-1]) and not torch.equal(after[-1], before[-1])


def test_fused_prefill_attention_is_exact_softmax_over_a_long_context(op):
    """Many chunks, the running max growing late (a large score near the end): the online
    softmax rescales what it summed before, to fp32 accuracy."""
    q, k, v, k_cache, v_cache, tables = step((4, 2, 64), torch.float32, [1500], [40])
    k_cache[tables[0][-5], 3] = q[-1, :2] * 0.5  # a much larger score for the last rows' heads 0-1
    got, _ = attend("fused", q, k, v, k_cache, v_cache, tables, [1500], [40])
    want, _ = attend("torch", q, k, v, k_cache, v_cache, tables, [1500], [40])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def call_args(dtype=torch.bfloat16):
    q, _, _, k_cache, v_cache, tables = step((9, 3, 64), dtype, [20, 40], [20, 10])
    out = torch.full_like(q, 7.0)
    return dict(out=out, q=q, k_cache=k_cache, v_cache=v_cache, starts=torch.tensor([0, 20]),
                query_lens=torch.tensor([20, 10]), block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables]),
                context_lens=torch.tensor([20, 40]), scale=0.125)  # fmt: skip


BAD_CALLS = {
    "chunk past q": ("starts", torch.tensor([0, 21]), "outside q"),
    "negative start": ("starts", torch.tensor([-1, 20]), "outside q"),
    "empty chunk": ("query_lens", torch.tensor([20, 0]), "outside q"),
    "context shorter than its chunk": ("context_lens", torch.tensor([19, 40]), "context length"),
    "context past its blocks": ("context_lens", torch.tensor([20, 49]), "context length"),
    "block id past the cache": ("block_tables", torch.tensor([[0, 1, 0], [2, 999, 3]]), "block id out of range"),
    "int32 starts": ("starts", torch.tensor([0, 20], dtype=torch.int32), "contiguous int64"),
    "lengths of another count": ("query_lens", torch.tensor([20, 10, 1]), "contiguous int64 \\[n\\] alike"),
    "fp32 q on a bf16 cache": ("q", torch.zeros(30, 9, 64), "share a dtype"),
    "head size 65": ("q", torch.zeros(30, 9, 65, dtype=torch.bfloat16), "head size"),
    "query heads not a multiple of kv heads": ("q", torch.zeros(30, 8, 64, dtype=torch.bfloat16), "Hq must be"),
}


@pytest.mark.parametrize("case", BAD_CALLS)
def test_a_call_out_of_bounds_is_refused_with_nothing_written(op, case):
    assert_refused_with_nothing_written(op, call_args(), *BAD_CALLS[case])

"""The fused paged decode attention (kernels/csrc/attention_cpu.cpp, loaded by kernels/cpu_fused.py):
what the layers compute with it equals the torch path (gathered blocks, masked SDPA) on every
head layout and dtype, in steps that mix decode rows with prefills; a call that would read or
write out of bounds is refused with nothing written."""

from __future__ import annotations

import pytest
import torch

from inference.layers.attention import torch_paged_attention
from inference.layers.attention_metadata import build_attention_metadata
from kernels import cpu_fused
from tests.kernels.test_cpu_fused import HAS_COMPILER

BLOCK = 16


@pytest.fixture(scope="module")
def op():
    if cpu_fused.fused_op() is None and not HAS_COMPILER:
        pytest.skip(f"no C++ compiler here: {cpu_fused.unavailable_reason()}")
    op = cpu_fused.attention_op()
    assert op is not None, f"a C++ compiler is here but the kernels did not build: {cpu_fused.unavailable_reason()}"
    return op


def step(heads, dtype, seq_lens, query_lens, seed=0):
    """A step's inputs: caches holding every sequence's earlier tokens (blocks shuffled, so a
    sequence's blocks are not neighbours), the step's q/k/v, and block tables."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    blocks = [-(-n // BLOCK) for n in seq_lens]
    order = torch.randperm(sum(blocks) + 3, generator=gen).tolist()
    tables, at = [], 0
    for b in blocks:
        tables.append(order[at : at + b])
        at += b
    k_cache = torch.randn(len(order), BLOCK, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(len(order), BLOCK, hkv, d, generator=gen).to(dtype)
    t = sum(query_lens)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, k_cache, v_cache, tables


def attend(kernel, q, k, v, k_cache, v_cache, tables, seq_lens, query_lens):
    meta = build_attention_metadata(seq_lens, query_lens, tables, BLOCK, decode_kernel=kernel)
    caches = (k_cache.clone(), v_cache.clone())
    return torch_paged_attention(q, k, v, caches, meta, q.shape[-1] ** -0.5), caches


STEPS = {  # (seq_lens, query_lens)
    "decode, lengths 1 to 300": ([1, 17, 16, 300, 33, 129, 2, 64], [1] * 8),
    "one stream": ([77], [1]),
    "decode beside prefills": ([40, 90, 5, 200, 31], [1, 90, 1, 12, 1]),
}
HEADS = [(9, 3, 64), (4, 4, 32), (8, 1, 128), (6, 2, cpu_fused.vector_width())]


@pytest.mark.parametrize("layout", STEPS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q-{h[1]}kv-d{h[2]}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=lambda d: str(d)[6:])
def test_fused_decode_attention_equals_the_torch_path(op, layout, heads, dtype):
    assert_fused_equals_torch(attend, heads, dtype, *STEPS[layout])


def assert_fused_equals_torch(attend, heads, dtype, seq_lens, query_lens) -> None:
    """attend("fused", ...) gives attend("torch", ...)'s output (fp32: to rounding; bf16 and
    fp16: to their precision) and leaves the caches alike."""
    inputs = step(heads, dtype, seq_lens, query_lens)
    want, want_caches = attend("torch", *inputs, seq_lens, query_lens)
    got, got_caches = attend("fused", *inputs, seq_lens, query_lens)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches, strict=True)), "the caches differ"


def test_fused_decode_attention_is_exact_softmax_over_a_long_context(op):
    """Many chunks, the running max growing late (a large score at the end): the online softmax
    rescales what it summed before, to fp32 accuracy."""
    q, k, v, k_cache, v_cache, tables = step((4, 2, 64), torch.float32, [2000], [1])
    k_cache[tables[0][-1], 3] = q[0, :2] * 0.5  # position 1987: a much larger score for heads 0-1
    got, _ = attend("fused", q, k, v, k_cache, v_cache, tables, [2000], [1])
    want, _ = attend("torch", q, k, v, k_cache, v_cache, tables, [2000], [1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def call_args(dtype=torch.bfloat16):
    q, _, _, k_cache, v_cache, tables = step((9, 3, 64), dtype, [20, 40], [1, 1])
    out = torch.full_like(q, 7.0)
    return dict(out=out, q=q, k_cache=k_cache, v_cache=v_cache, rows=torch.tensor([0, 1]),
                block_tables=torch.tensor([t + [0] * (3 - len(t)) for t in tables]),
                context_lens=torch.tensor([20, 40]), scale=0.125)  # fmt: skip


BAD_CALLS = {
    "row past q": ("rows", torch.tensor([0, 2]), "row out of range"),
    "negative row": ("rows", torch.tensor([-1, 1]), "row out of range"),
    "context past its blocks": ("context_lens", torch.tensor([20, 49]), "context length"),
    "empty context": ("context_lens", torch.tensor([0, 40]), "context length"),
    "block id past the cache": ("block_tables", torch.tensor([[0, 1, 0], [2, 999, 3]]), "block id out of range"),
    "int32 rows": ("rows", torch.tensor([0, 1], dtype=torch.int32), "rows: contiguous int64"),
    "fp32 q on a bf16 cache": ("q", torch.zeros(2, 9, 64), "share a dtype"),
    "head size 65": ("q", torch.zeros(2, 9, 65, dtype=torch.bfloat16), "head size"),
    "query heads not a multiple of kv heads": ("q", torch.zeros(2, 8, 64, dtype=torch.bfloat16), "Hq must be"),
}


def assert_refused_with_nothing_written(op, args: dict, name: str, value: torch.Tensor, message: str) -> None:
    """op(**args) with args[name] = value raises `message`, and out is as it was."""
    args[name] = value
    if name == "q":
        args["out"] = torch.full(value.shape, 7.0, dtype=value.dtype)
    before = args["out"].clone()
    with pytest.raises(RuntimeError, match=message):
        op(**args)
    assert torch.equal(args["out"], before)


@pytest.mark.parametrize("case", BAD_CALLS)
def test_a_call_out_of_bounds_is_refused_with_nothing_written(op, case):
    assert_refused_with_nothing_written(op, call_args(), *BAD_CALLS[case])

"""How decode rows and prefill chunks attend on this CPU, measured at start-up: torch ops or the
fused C++ kernels.

    torch   per decode group, the rows' KV blocks gathered into a padded buffer (index_select),
            then one masked SDPA; per prefill chunk, one causal SDPA (inference/layers/attention.py)
    fused   decode: kernels/csrc/attention_cpu.cpp: each (sequence, kv head) reads its blocks in
            place, an online softmax over exactly its context, in fp32 (no gather, no padding,
            no mask); prefill: kernels/csrc/prefill_attention_cpu.cpp, every chunk of the step
            in one call, tiles of query rows against the blocks in place, causal, in fp32

"auto" times both on the model's own heads, through the same paged_attention the layers call,
for decode (a batch of 32 decode rows at mixed context lengths) and for prefill (chunks of mixed
lengths, one after a cached prefix) apart, and takes the faster for each; the fused kernel must
win by SWITCH_FACTOR. "fused" or "torch" forces one for both (`--attention-kernel`, env
INFERENCE_ATTENTION_KERNEL). The choices are the matmul plan's `attention_kernel` and
`prefill_attention_kernel`: logged, in /v1/base_model and in the metric
loraplex:matmul_plan_info{shape_class="attention_kernel" / "prefill_attention_kernel"}.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from inference.layers.attention import torch_paged_attention
from inference.layers.attention_metadata import build_attention_metadata
from inference.layers.matmul_plan import FUSED_KERNEL, TORCH_KERNEL, MatmulPlan, race
from kernels import cpu_fused

ATTENTION_KERNEL_CHOICES = ("auto", FUSED_KERNEL, TORCH_KERNEL)
SWITCH_FACTOR = 0.9  # the fused kernel replaces torch's when it takes under this share of its time
BLOCK_SIZE = 16
# the timed batch: 32 decode rows, contexts spread over 64..512 tokens
CONTEXT_LENS = [64 + (448 * i) // 31 for i in range(32)]
# the timed prefill step: (context length, chunk length) of 8 chunks from 16 to 256 tokens,
# the last after a cached prefix of 128
PREFILL_CHUNKS = [(16 + (240 * i) // 7, 16 + (240 * i) // 7) for i in range(7)] + [(256, 128)]


def fused_unsupported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the fused kernel cannot take these heads (None: it can), as its own checks would."""
    vector = cpu_fused.vector_width()
    if dtype not in cpu_fused.ATTENTION_DTYPES:
        return f"dtype {dtype} (it takes {', '.join(sorted(str(d) for d in cpu_fused.ATTENTION_DTYPES))})"
    if head_dim % vector or head_dim > 16 * vector:
        return f"head size {head_dim} (a multiple of {vector} up to {16 * vector} here)"
    if num_kv_heads < 1 or num_heads % num_kv_heads or num_heads // num_kv_heads > 16:
        return f"{num_heads} query heads over {num_kv_heads} kv heads (1 to 16 per kv head)"
    return None


def with_attention_kernel(
    plan: MatmulPlan, requested: str, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device,
) -> MatmulPlan:
    """`plan` with its decode and prefill attention kernels: "torch"; "fused" (RuntimeError where
    they cannot be built here or cannot take these heads, the reason given); "auto": the faster
    of each (see module doc), torch where the fused ones are unavailable. CUDA keeps its own
    backend: torch here."""
    if requested not in ATTENTION_KERNEL_CHOICES:
        raise ValueError(f"attention kernel must be one of {', '.join(ATTENTION_KERNEL_CHOICES)}, got {requested!r}")
    if requested == TORCH_KERNEL or device.type != "cpu":
        return replace(plan, attention_kernel=TORCH_KERNEL, prefill_attention_kernel=TORCH_KERNEL)
    op = cpu_fused.fused_op()  # builds (or loads) the library that holds the attention op
    why = f"cannot be built here ({cpu_fused.unavailable_reason()})" if op is None else fused_unsupported(
        num_heads, num_kv_heads, head_dim, dtype)  # fmt: skip
    if requested == FUSED_KERNEL:
        if why is not None:
            raise RuntimeError(f"attention kernel fused: {why}")
        return replace(plan, attention_kernel=FUSED_KERNEL, prefill_attention_kernel=FUSED_KERNEL)
    if why is not None:
        return replace(plan, attention_kernel=TORCH_KERNEL, prefill_attention_kernel=TORCH_KERNEL)
    heads = (num_heads, num_kv_heads, head_dim, dtype)
    picks, timings = {}, dict(plan.timings)
    for name, context_lens, query_lens in (
        ("attention_kernel", CONTEXT_LENS, [1] * len(CONTEXT_LENS)),
        ("prefill_attention_kernel", *map(list, zip(*PREFILL_CHUNKS, strict=True))),
    ):
        seconds = race({kernel: _step(*heads, kernel, context_lens, query_lens) for kernel in (TORCH_KERNEL, FUSED_KERNEL)})
        picks[name] = FUSED_KERNEL if seconds[FUSED_KERNEL] < SWITCH_FACTOR * seconds[TORCH_KERNEL] else TORCH_KERNEL
        timings[name] = seconds
    return replace(plan, **picks, timings=timings)


def _step(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kernel: str,
          context_lens: list[int], query_lens: list[int]):  # fmt: skip
    """One layer's paged attention for a timed step with `kernel` on both its decode rows and its
    prefill chunks: a callable."""
    tables, start = [], 0
    for n in context_lens:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    k_cache = torch.randn(start, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(start, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    meta = build_attention_metadata(context_lens, query_lens, tables, BLOCK_SIZE, decode_kernel=kernel,
                                    prefill_kernel=kernel)  # fmt: skip
    rows = sum(query_lens)
    q = torch.randn(rows, num_heads, head_dim).to(dtype)
    k = torch.randn(rows, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(rows, num_kv_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    return lambda: torch_paged_attention(q, k, v, (k_cache, v_cache), meta, scale)

"""How decode rows attend on this CPU, measured at start-up: torch ops or the fused C++ kernel.

    torch   per decode group, the rows' KV blocks gathered into a padded buffer (index_select),
            then one masked SDPA (inference/layers/attention.py)
    fused   kernels/csrc/attention_cpu.cpp: each (sequence, kv head) reads its blocks in place,
            an online softmax over exactly its context, in fp32 (no gather, no padding, no mask)

"auto" times both on the model's own heads (a batch of 32 decode rows at mixed context
lengths, through the same paged_attention the layers call) and takes the faster; the fused
kernel must win by SWITCH_FACTOR. "fused" or "torch" forces one (`--attention-kernel`, env
INFERENCE_ATTENTION_KERNEL). The choice is the matmul plan's `attention_kernel`: logged, in
/v1/base_model and in the metric loraplex:matmul_plan_info{shape_class="attention_kernel"}.
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
    """`plan` with its decode attention kernel: "torch"; "fused" (RuntimeError where it cannot be
    built here or cannot take these heads, the reason given); "auto": the faster (see module
    doc), torch where the fused one is unavailable. CUDA keeps its own backend: torch here."""
    if requested not in ATTENTION_KERNEL_CHOICES:
        raise ValueError(f"attention kernel must be one of {', '.join(ATTENTION_KERNEL_CHOICES)}, got {requested!r}")
    if requested == TORCH_KERNEL or device.type != "cpu":
        return replace(plan, attention_kernel=TORCH_KERNEL)
    op = cpu_fused.fused_op()  # builds (or loads) the library that holds the attention op
    why = f"cannot be built here ({cpu_fused.unavailable_reason()})" if op is None else fused_unsupported(
        num_heads, num_kv_heads, head_dim, dtype)  # fmt: skip
    if requested == FUSED_KERNEL:
        if why is not None:
            raise RuntimeError(f"attention kernel fused: {why}")
        return replace(plan, attention_kernel=FUSED_KERNEL)
    if why is not None:
        return replace(plan, attention_kernel=TORCH_KERNEL)
    seconds = race({kernel: _decode_step(num_heads, num_kv_heads, head_dim, dtype, kernel)
                     for kernel in (TORCH_KERNEL, FUSED_KERNEL)})  # fmt: skip
    best = FUSED_KERNEL if seconds[FUSED_KERNEL] < SWITCH_FACTOR * seconds[TORCH_KERNEL] else TORCH_KERNEL
    return replace(plan, attention_kernel=best, timings={**plan.timings, "attention_kernel": seconds})


def _decode_step(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kernel: str):
    """One layer's paged attention for the timed batch with `kernel`: a callable."""
    tables, start = [], 0
    for n in CONTEXT_LENS:
        blocks = -(-n // BLOCK_SIZE)
        tables.append(list(range(start, start + blocks)))
        start += blocks
    k_cache = torch.randn(start, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(start, BLOCK_SIZE, num_kv_heads, head_dim).to(dtype)
    meta = build_attention_metadata(CONTEXT_LENS, [1] * len(CONTEXT_LENS), tables, BLOCK_SIZE, decode_kernel=kernel)
    rows = len(CONTEXT_LENS)
    q = torch.randn(rows, num_heads, head_dim).to(dtype)
    k = torch.randn(rows, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(rows, num_kv_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    return lambda: torch_paged_attention(q, k, v, (k_cache, v_cache), meta, scale)

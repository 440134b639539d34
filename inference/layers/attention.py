"""Attention over a paged KV cache.

The cache of one layer is two tensors, k and v, each [num_blocks, block_size, n_kv_heads, head_dim]
(`KVCache`); where each token's row is, and which rows attend to which, is in the step's
`AttentionMetadata` (attention_metadata.py), shared by every layer:
  - decode rows are batched into one SDPA call per length group: their blocks are gathered
    into a padded [n, Hkv, ctx, D] tensor and a boolean mask hides padding; the Hq/Hkv query
    heads that share a kv head ride along as extra query rows, so the KV is never repeated per
    query head. Where the step's decode_kernel is "fused" (the CPU's C++ kernel, chosen at
    start-up by inference/layers/attention_plan.py) one call takes every decode row instead,
    reading the blocks in place;
  - prefill chunks run one SDPA call per sequence: causal over the chunk itself when nothing
    is cached before it, otherwise with a mask shifted by the cached prefix. Where the step's
    prefill_kernel is "fused" (the CPU's C++ kernel, chosen at start-up like the decode one)
    one call takes every chunk instead, reading its blocks in place.

`paged_attention` dispatches on the device type, so a Triton/CUDA kernel can be registered
with `register_attention_backend` and take the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from inference.layers.attention_metadata import AttentionMetadata, DecodeGroup, PrefillSeq
from kernels import cpu_fused

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, D]


def allocate_kv_cache(
    *,
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[KVCache]:
    """One zeroed (k, v) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim].

    Zeroed, not empty: padding slots are masked out of the softmax, but a NaN left in freed
    memory would still poison the weighted sum (0 · NaN = NaN).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(num_layers)
    ]


AttentionBackend = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, KVCache, AttentionMetadata, float], torch.Tensor
]
_BACKENDS: dict[str, AttentionBackend] = {}


def register_attention_backend(device_type: str, backend: AttentionBackend) -> None:
    """Route `paged_attention` on tensors of `device_type` (e.g. "cuda") to `backend`."""
    _BACKENDS[device_type] = backend


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write the new k/v into the cache, then attend causally per sequence. -> [T, Hq, D]"""
    backend = _BACKENDS.get(q.device.type, torch_paged_attention)
    return backend(q, k, v, kv_cache, meta, scale)


def torch_paged_attention(
    q, k, v, kv_cache: KVCache, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The portable path: index_copy_ into the cache, SDPA over gathered blocks."""
    k_cache, v_cache = kv_cache  # [num_blocks, block_size, Hkv, D]
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    k_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, Hkv, D).index_copy_(0, meta.slot_mapping, v)

    fused = cpu_fused.attention_op() if meta.decode_kernel == "fused" else None
    if fused is None and len(meta.decode_groups) == 1 and meta.decode_groups[0].rows_slice == slice(0, T):
        return _decode(
            q, k_cache, v_cache, meta.decode_groups[0], meta, scale, 0
        )  # pure decode step
    out = q.new_empty(T, Hq, D)
    for g, group in enumerate(meta.decode_groups):
        if fused is not None:  # the blocks read in place, each row written where it belongs
            fused(out, q, k_cache, v_cache, group.rows, group.block_tables, group.context_lens, scale)
            continue
        o = _decode(q, k_cache, v_cache, group, meta, scale, g)  # [n, Hq, D]
        if group.rows_slice is not None:
            out[group.rows_slice] = o
        else:
            out.index_copy_(0, group.rows, o)
    for p in meta.prefills:
        out[p.start : p.end] = _prefill(q, k, v, k_cache, v_cache, p, scale)
    batch = meta.prefill_batch
    if batch is not None:  # the chunks' k/v are in the cache now: the kernel reads them there
        prefill_op = cpu_fused.prefill_attention_op()
        if prefill_op is None:
            raise RuntimeError(f"prefill kernel fused: the CPU kernels are not loaded ({cpu_fused.unavailable_reason()})")
        prefill_op(out, q, k_cache, v_cache, batch.starts, batch.query_lens, batch.block_tables, batch.context_lens,
                   scale)  # fmt: skip
    return out


def _gather(
    cache: torch.Tensor, block_ids: torch.Tensor, meta: AttentionMetadata, key: tuple
) -> torch.Tensor:
    # cache [num_blocks, bs, Hkv, D], block_ids [...] -> [..., bs, Hkv, D] in a per-step buffer
    shape = (block_ids.numel(), *cache.shape[1:])
    buf = meta.workspace.get(key)
    if buf is None or buf.shape != shape or buf.dtype != cache.dtype or buf.device != cache.device:
        buf = meta.workspace[key] = cache.new_empty(shape)
    torch.index_select(cache, 0, block_ids.reshape(-1), out=buf)
    return buf.view(*block_ids.shape, *cache.shape[1:])


def _decode(q, k_cache, v_cache, group: DecodeGroup, meta, scale, g: int) -> torch.Tensor:
    n, B = group.block_tables.shape
    _, bs, Hkv, D = k_cache.shape
    Hq = q.shape[1]
    qd = q[group.rows_slice] if group.rows_slice is not None else q[group.rows]  # [n, Hq, D]
    # query heads sharing a kv head become extra query rows of it: [n, Hkv, Hq/Hkv, D]
    qd = qd.reshape(n, Hkv, Hq // Hkv, D)
    kd = _gather(k_cache, group.block_tables, meta, ("decode_k", g)).view(n, B * bs, Hkv, D)
    vd = _gather(v_cache, group.block_tables, meta, ("decode_v", g)).view(n, B * bs, Hkv, D)
    mask = group.mask
    if group.same_len is not None:  # no padding to hide: the exact context, no mask
        kd, vd, mask = kd[:, : group.same_len], vd[:, : group.same_len], None
    o = F.scaled_dot_product_attention(
        qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [n, Hkv, Hq/Hkv, D]
    return o.reshape(n, Hq, D)


def _prefill(q, k, v, k_cache, v_cache, p: PrefillSeq, scale) -> torch.Tensor:
    qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
    if p.block_ids is None:  # the whole context is this chunk: use the new k/v directly
        kp = k[p.start : p.end]  # [q, Hkv, D]
        vp = v[p.start : p.end]
    else:
        _, bs, Hkv, D = k_cache.shape
        kp = k_cache[p.block_ids].view(-1, Hkv, D)[: p.context_len]  # [ctx, Hkv, D]
        vp = v_cache[p.block_ids].view(-1, Hkv, D)[: p.context_len]
    o = F.scaled_dot_product_attention(
        qp,
        kp.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx, D]
        vp.transpose(0, 1).unsqueeze(0),
        attn_mask=p.mask,
        is_causal=p.mask is None,
        scale=scale,
        enable_gqa=True,
    )  # [1, Hq, q, D]
    return o[0].transpose(0, 1)  # [q, Hq, D]

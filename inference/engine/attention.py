"""Attention over a paged KV cache.

The cache of one layer is two tensors, k and v, each [num_blocks, block_size, n_kv_heads, head_dim].
A sequence's token at position p lives in block `block_table[p // block_size]`, row
`p % block_size`; flattened, that is slot `block * block_size + p % block_size`.

One step of the engine runs a flattened batch of T new tokens (sequence after sequence).
Sequence i brings query_lens[i] new tokens at positions [seq_lens[i] - query_lens[i], seq_lens[i]):
  - decode rows (query_len == 1) are batched into one SDPA call per length group: their
    blocks are gathered into a padded [n, Hkv, ctx, D] tensor and a boolean mask hides padding;
    the Hq/Hkv query heads that share a kv head ride along as extra query rows, so the KV is
    never repeated per query head;
  - prefill chunks (query_len > 1) run one SDPA call per sequence: causal over the chunk itself
    when nothing is cached before it, otherwise with a mask shifted by the cached prefix.

`build_attention_metadata` computes every index and mask once per step; all layers share them.
`paged_attention` dispatches on the device type, so a Triton/CUDA kernel can be registered
with `register_attention_backend` and take the same inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, Hkv, D]


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended in one SDPA call."""

    rows: torch.Tensor  # [n] long: row of each decode token in T
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with block 0 (masked out)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, True = attend
    rows_slice: slice | None  # the same rows as a slice when they are consecutive (cheaper)


@dataclass
class PrefillSeq:
    """One sequence whose chunk brings more than one token."""

    start: int  # its rows in T: [start, end)
    end: int
    context_len: int  # tokens attended to (cached prefix + this chunk)
    block_ids: torch.Tensor | None  # [ceil(context_len / block_size)] long; None: no cached prefix
    mask: (
        torch.Tensor | None
    )  # [query_len, context_len] bool; None: plain causal (no cached prefix)


@dataclass
class AttentionMetadata:
    num_tokens: int  # T
    block_size: int
    slot_mapping: torch.Tensor  # [T] long: cache slot each new token's k/v is written to
    seq_lens: torch.Tensor  # [S] long: context length of each sequence after this step
    query_start_loc: torch.Tensor  # [S + 1] long: sequence i's rows are [loc[i], loc[i+1])
    block_tables: torch.Tensor  # [S, max_blocks] long, padded with 0
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSeq]
    # Gather buffers reused by every layer of the step (allocating them per layer costs page faults).
    workspace: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_decode_tokens(self) -> int:
        return sum(len(g.rows) for g in self.decode_groups)


def allocate_kv_cache(
    config, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> list[KVCache]:
    """One zeroed (k, v) pair per layer, each [num_blocks, block_size, Hkv, D].

    Zeroed, not empty: padding slots are masked out of the softmax, but a NaN left in freed
    memory would still poison the weighted sum (0 · NaN = NaN).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(config.num_hidden_layers)
    ]


# --- metadata ------------------------------------------------------------------------------

# Decode rows are split into length groups when that saves at least this many padded context
# tokens per extra group (one group's fixed cost, a handful of ops per layer, is about what
# attending over a few hundred padded tokens costs on a CPU).
_GROUP_SPLIT_MIN_SAVING = 512


def build_attention_metadata(
    seq_lens: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Everything the layers need for one step, computed once.

    seq_lens[i]: tokens of sequence i once this step's are in; query_lens[i]: how many of them
    are new this step; block_tables[i]: its blocks, in position order.
    """
    S = len(seq_lens)
    if S == 0:
        raise ValueError("seq_lens: empty batch")
    if len(query_lens) != S or len(block_tables) != S:
        raise ValueError(
            f"seq_lens, query_lens and block_tables must have one entry per sequence, "
            f"got {S}, {len(query_lens)}, {len(block_tables)}"
        )
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for i, (seq_len, q_len, table) in enumerate(
        zip(seq_lens, query_lens, block_tables, strict=True)
    ):
        if not 1 <= q_len <= seq_len:
            raise ValueError(
                f"query_lens[{i}] must be in [1, seq_lens[{i}]={seq_len}], got {q_len}"
            )
        if len(table) * block_size < seq_len:
            raise ValueError(
                f"block_tables[{i}] has {len(table)} blocks of {block_size}, too few for seq_lens[{i}]={seq_len}"
            )

    max_blocks = max(len(t) for t in block_tables)
    table = torch.tensor(
        [t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long
    )  # [S, B]
    lens = torch.tensor(seq_lens, dtype=torch.long)  # [S]
    q_lens = torch.tensor(query_lens, dtype=torch.long)  # [S]
    loc = torch.zeros(S + 1, dtype=torch.long)
    torch.cumsum(q_lens, 0, out=loc[1:])  # [S + 1]
    T = int(loc[-1])

    # slot of every new token: its sequence's block for that position, and the row in it
    seq_of_token = torch.repeat_interleave(torch.arange(S), q_lens)  # [T]
    positions = (lens - q_lens)[seq_of_token] + torch.arange(T) - loc[:-1][seq_of_token]  # [T]
    slot_mapping = (
        table[seq_of_token, positions // block_size] * block_size + positions % block_size
    )

    decode_ids = [i for i in range(S) if query_lens[i] == 1]
    decode_groups = [
        _decode_group(ids, seq_lens, loc, table, lens, block_size, device)
        for ids in _split_by_length(decode_ids, seq_lens, block_size)
    ]
    prefills = [
        _prefill_seq(
            i, seq_lens[i], query_lens[i], int(loc[i]), block_tables[i], block_size, device
        )
        for i in range(S)
        if query_lens[i] > 1
    ]
    return AttentionMetadata(
        num_tokens=T,
        block_size=block_size,
        slot_mapping=slot_mapping.to(device),
        seq_lens=lens.to(device),
        query_start_loc=loc.to(device),
        block_tables=table.to(device),
        decode_groups=decode_groups,
        prefills=prefills,
    )


def _split_by_length(ids: list[int], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Group decode sequences by length: sort, then cut in two where that saves the most padded
    context, recursively, while a cut saves at least _GROUP_SPLIT_MIN_SAVING tokens."""
    if not ids:
        return []
    ids = sorted(ids, key=lambda i: seq_lens[i])
    blocks = [-(-seq_lens[i] // block_size) for i in ids]  # ceil, ascending

    def split(lo: int, hi: int) -> list[list[int]]:  # ids[lo:hi] padded to blocks[hi - 1]
        whole = (hi - lo) * blocks[hi - 1]
        best_cut, best_cost = hi, whole
        for cut in range(lo + 1, hi):
            cost = (cut - lo) * blocks[cut - 1] + (hi - cut) * blocks[hi - 1]
            if cost < best_cost:
                best_cut, best_cost = cut, cost
        if best_cut == hi or (whole - best_cost) * block_size < _GROUP_SPLIT_MIN_SAVING:
            return [sorted(ids[lo:hi])]  # back in row order: rows stay a slice if they can
        return split(lo, best_cut) + split(best_cut, hi)

    return split(0, len(ids))


def _decode_group(ids, seq_lens, loc, table, lens, block_size, device) -> DecodeGroup:
    idx = torch.tensor(ids, dtype=torch.long)
    rows = loc[:-1][idx]  # [n]
    n_blocks = -(-max(seq_lens[i] for i in ids) // block_size)
    ctx = n_blocks * block_size
    mask = torch.arange(ctx) < lens[idx, None]  # [n, ctx]
    first = int(rows[0])
    consecutive = bool((rows == torch.arange(first, first + len(ids))).all())
    return DecodeGroup(
        rows=rows.to(device),
        block_tables=table[idx, :n_blocks].contiguous().to(device),
        mask=mask[:, None, None, :].to(device),
        rows_slice=slice(first, first + len(ids)) if consecutive else None,
    )


def _prefill_seq(i, seq_len, q_len, start, block_table, block_size, device) -> PrefillSeq:
    if seq_len == q_len:  # nothing cached before this chunk
        return PrefillSeq(start, start + q_len, seq_len, block_ids=None, mask=None)
    n_blocks = -(-seq_len // block_size)
    # query j sits at position seq_len - q_len + j and sees keys at positions <= that
    query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]  # [q, 1]
    mask = torch.arange(seq_len)[None, :] <= query_pos  # [q, ctx]
    return PrefillSeq(
        start,
        start + q_len,
        seq_len,
        block_ids=torch.tensor(block_table[:n_blocks], dtype=torch.long, device=device),
        mask=mask.to(device),
    )


# --- attention -----------------------------------------------------------------------------

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

    if len(meta.decode_groups) == 1 and meta.decode_groups[0].rows_slice == slice(0, T):
        return _decode(
            q, k_cache, v_cache, meta.decode_groups[0], meta, scale, 0
        )  # pure decode step
    out = q.new_empty(T, Hq, D)
    for g, group in enumerate(meta.decode_groups):
        o = _decode(q, k_cache, v_cache, group, meta, scale, g)  # [n, Hq, D]
        if group.rows_slice is not None:
            out[group.rows_slice] = o
        else:
            out.index_copy_(0, group.rows, o)
    for p in meta.prefills:
        out[p.start : p.end] = _prefill(q, k, v, k_cache, v_cache, p, scale)
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
    o = F.scaled_dot_product_attention(
        qd, kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=group.mask, scale=scale
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

"""What every attention layer of one step shares: indices and masks, computed once per step.

One step of the engine runs a flattened batch of T new tokens (sequence after sequence).
Sequence i brings query_lens[i] new tokens at positions [seq_lens[i] - query_lens[i], seq_lens[i]);
its token at position p has its KV in block `block_table[p // block_size]`, row `p % block_size`
(flattened: slot `block * block_size + p % block_size`). The metadata splits the rows the way
inference/layers/attention.py attends to them:
  - decode rows (query_len == 1) in length groups (`DecodeGroup`), each one SDPA call over
    gathered blocks with a padding mask;
  - prefill chunks (query_len > 1) one by one (`PrefillSeq`), causal, with a mask shifted by
    the cached prefix when there is one; or, where the step's prefill_kernel is "fused", all
    in one call of the CPU's C++ kernel (`PrefillBatch`: the chunks' rows and blocks, no masks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DecodeGroup:
    """Decode rows of similar context length, attended in one SDPA call."""

    rows: torch.Tensor  # [n] long: row of each decode token in T
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with block 0 (masked out)
    context_lens: torch.Tensor  # [n] long: positions each row attends (its sequence's length)
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, True = attend
    rows_slice: slice | None  # the same rows as a slice when they are consecutive (cheaper)
    # Every sequence of the group has this context length (a single stream always): attend
    # exactly those rows, no mask (SDPA without a mask is 2-3x faster at batch 1). None: mixed.
    same_len: int | None = None


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
class PrefillBatch:
    """Every prefill chunk of a step, for the fused kernel's one call (kernels/cpu_fused.py's
    prefill_attention_op): chunk i's rows are [starts[i], starts[i] + query_lens[i]) and attend
    causally over the first context_lens[i] positions of block_tables[i] (its cached prefix,
    then itself)."""

    starts: torch.Tensor  # [n] long
    query_lens: torch.Tensor  # [n] long
    block_tables: torch.Tensor  # [n, max_blocks] long, padded with block 0 (never read)
    context_lens: torch.Tensor  # [n] long


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
    # How decode rows attend: "torch" (gather the blocks, one masked SDPA per group) or "fused"
    # (the C++ paged kernel of kernels/cpu_fused.py, reading the blocks in place): the matmul
    # plan's attention_kernel, measured at start-up (inference/layers/matmul_plan.py).
    decode_kernel: str = "torch"
    # Where prefill chunks take the fused C++ kernel (build_attention_metadata's prefill_kernel,
    # the matmul plan's prefill_attention_kernel: inference/layers/attention_plan.py), all of
    # them for its one call, and `prefills` is empty; None: one SDPA call per chunk (`prefills`).
    prefill_batch: PrefillBatch | None = None

    @property
    def num_decode_tokens(self) -> int:
        return sum(len(g.rows) for g in self.decode_groups)


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
    decode_kernel: str = "torch",
    prefill_kernel: str = "torch",
) -> AttentionMetadata:
    """Everything the layers need for one step, computed once.

    seq_lens[i]: tokens of sequence i once this step's are in; query_lens[i]: how many of them
    are new this step; block_tables[i]: its blocks, in position order. decode_kernel: see
    AttentionMetadata (the fused kernel pads nothing, so its decode rows form one group);
    prefill_kernel "fused": the chunks go to `prefill_batch` (see there), "torch": to `prefills`.
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
        for ids in (_split_by_length(decode_ids, seq_lens, block_size) if decode_kernel != "fused"
                    else [decode_ids] if decode_ids else [])
    ]
    prefill_ids = [i for i in range(S) if query_lens[i] > 1]
    prefills, prefill_batch = [], None
    if prefill_kernel == "fused" and prefill_ids:
        idx = torch.tensor(prefill_ids, dtype=torch.long)
        prefill_batch = PrefillBatch(
            starts=loc[:-1][idx].to(device),
            query_lens=q_lens[idx].to(device),
            block_tables=table[idx].contiguous().to(device),
            context_lens=lens[idx].to(device),
        )
    else:
        prefills = [
            _prefill_seq(i, seq_lens[i], query_lens[i], int(loc[i]), block_tables[i], block_size, device)
            for i in prefill_ids
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
        decode_kernel=decode_kernel,
        prefill_batch=prefill_batch,
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
    longest = max(seq_lens[i] for i in ids)
    n_blocks = -(-longest // block_size)
    ctx = n_blocks * block_size
    mask = torch.arange(ctx) < lens[idx, None]  # [n, ctx]
    first = int(rows[0])
    consecutive = bool((rows == torch.arange(first, first + len(ids))).all())
    return DecodeGroup(
        rows=rows.to(device),
        block_tables=table[idx, :n_blocks].contiguous().to(device),
        context_lens=lens[idx].to(device),
        mask=mask[:, None, None, :].to(device),
        rows_slice=slice(first, first + len(ids)) if consecutive else None,
        same_len=longest if all(seq_lens[i] == longest for i in ids) else None,
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

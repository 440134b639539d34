"""Paged KV-cache bookkeeping: fixed-size blocks, shared by reference count, reused by content.

Plain Python, no tensors: the block manager only decides *which* physical blocks a
sequence owns; the model runner turns a sequence's block table into slot indices.
Ask-then-act pairs (`can_allocate`/`allocate`, `can_append`/`append`) let the
scheduler check capacity before it commits to a decision.

Automatic prefix caching (vLLM's, keyed for many adapters and many tenants):

    block hash = sha256(parent block's hash | namespace | the block's token ids)
    namespace  = sha256([adapter id, cache salt])       (PrefixKey: per sequence)

  - Once every token of a *full* block has its KV computed, the block is registered under its
    hash (`cache_computed`). KV computed under one adapter is wrong for another, so the
    adapter's immutable id is in the key; the salt (one per tenant, set by the gateway) keeps one
    tenant from finding another's prompts by timing hits.
  - A sequence being admitted looks up the chain of its full blocks (`find_cached`) and shares
    the longest cached prefix: those blocks gain a reference, its `num_computed_tokens` starts
    after them, and only the rest is computed. The lookup stops short of the last token, which
    is always computed (its logits give the next token), so a shared block is never written.
  - A block whose last reference goes keeps its hash and stays cached while free; allocation
    takes never-cached free blocks first, then evicts the least recently freed cached block.
    Blocks in use are never evicted.
  - Blocks of adapters that are no longer loaded can never be hit again: `retain_adapters`
    forgets their hashes and puts the free ones first in line for reuse.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

_ROOT_HASH = bytes(32)  # the "parent" of a sequence's first block


@dataclass(frozen=True)
class PrefixKey:
    """What, besides the tokens, decides whether cached KV can be reused."""

    adapter_id: str | None  # the adapter's immutable id (content hash); None: the base model
    salt: str | None  # cache_salt: requests with different salts never share blocks
    namespace: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        encoded = json.dumps([self.adapter_id, self.salt]).encode()
        object.__setattr__(self, "namespace", hashlib.sha256(encoded).digest())


def hash_block(parent: bytes, key: PrefixKey, token_ids: Sequence[int]) -> bytes:
    """A full block's content hash: fixed-width fields, so no two inputs encode alike."""
    return hashlib.sha256(parent + key.namespace + array("q", token_ids).tobytes()).digest()


class HasBlockTable(Protocol):
    """What the block manager needs to know about a sequence."""

    block_table: list[int]
    num_computed_tokens: int
    # Prefix caching: the key (None: this sequence neither looks up nor registers blocks), the
    # hash chain of its full blocks so far, and how many leading blocks of its table are cached.
    prefix_key: PrefixKey | None
    block_hashes: list[bytes]
    num_cached_blocks: int

    @property
    def num_tokens(self) -> int: ...

    def token_ids_slice(self, start: int, stop: int) -> list[int]: ...


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks  # sequences holding each block
        self._plain: deque[int] = deque(range(num_blocks))  # free and not cached
        self._evictable: OrderedDict[int, None] = (
            OrderedDict()
        )  # free and cached, least recent first
        self._cached: dict[bytes, int] = {}  # block hash -> block
        self._hash: list[bytes | None] = [None] * num_blocks
        self._adapter: list[str | None] = [None] * num_blocks  # adapter id of a cached block
        self._by_adapter: dict[str, set[int]] = {}  # adapter id -> its cached blocks

    # -- capacity -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or not."""
        return len(self._cached)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    def is_cached(self, block: int) -> bool:
        return self._hash[block] is not None

    def _blocks_missing(self, seq: HasBlockTable, num_new_tokens: int, num_cached: int) -> int:
        tokens = seq.num_computed_tokens + num_cached * self.block_size + num_new_tokens
        return max(0, self.blocks_for_tokens(tokens) - len(seq.block_table) - num_cached)

    # -- prefix cache -------------------------------------------------------------
    def find_cached(self, seq: HasBlockTable) -> list[int]:
        """The blocks holding the longest cached prefix of `seq` (a sequence without KV), at
        most up to its last token. Looks only; `allocate(..., cached=)` takes them."""
        if not self.enable_prefix_caching or seq.prefix_key is None or seq.block_table:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        self._hash_blocks(seq, limit)
        hits = []
        for block_hash in seq.block_hashes[:limit]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def cache_computed(self, seq: HasBlockTable) -> None:
        """Register `seq`'s full blocks whose KV is now computed (after each step)."""
        if not self.enable_prefix_caching or seq.prefix_key is None:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            return
        self._hash_blocks(seq, full)
        for i in range(seq.num_cached_blocks, full):
            block_hash, block = seq.block_hashes[i], seq.block_table[i]
            # Two sequences that computed the same block at once: the first one registered wins,
            # the other's copy stays private and goes back to the plain free list when freed.
            if block_hash not in self._cached and self._hash[block] is None:
                self._cached[block_hash] = block
                self._hash[block] = block_hash
                adapter_id = seq.prefix_key.adapter_id
                if adapter_id is not None:
                    self._adapter[block] = adapter_id
                    self._by_adapter.setdefault(adapter_id, set()).add(block)
        seq.num_cached_blocks = full

    def retain_adapters(self, live_ids: Iterable[str]) -> int:
        """Forget the cached blocks of every adapter not in `live_ids` (it was unloaded: its
        blocks can never be hit again); the free ones are the next to be reused. Returns how
        many blocks were forgotten."""
        gone = set(self._by_adapter) - set(live_ids)
        forgotten = 0
        for adapter_id in gone:
            for block in list(self._by_adapter[adapter_id]):
                self._uncache(block)
                if block in self._evictable:
                    del self._evictable[block]
                    self._plain.appendleft(block)
                forgotten += 1
        return forgotten

    def _hash_blocks(self, seq: HasBlockTable, num_blocks: int) -> None:
        """Extend seq.block_hashes to cover its first `num_blocks` full blocks."""
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else _ROOT_HASH
            seq.block_hashes.append(
                hash_block(parent, seq.prefix_key, seq.token_ids_slice(i * bs, (i + 1) * bs))
            )

    def _uncache(self, block: int) -> None:
        block_hash = self._hash[block]
        if self._cached.get(block_hash) == block:
            del self._cached[block_hash]
        self._hash[block] = None
        adapter_id = self._adapter[block]
        if adapter_id is not None:
            self._adapter[block] = None
            blocks = self._by_adapter[adapter_id]
            blocks.discard(block)
            if not blocks:
                del self._by_adapter[adapter_id]

    # -- ask / act --------------------------------------------------------------
    def can_allocate(
        self, seq: HasBlockTable, num_new_tokens: int, cached: Sequence[int] = ()
    ) -> bool:
        """Whether `num_new_tokens` more tokens of `seq` fit in its blocks plus free ones (after
        sharing the `cached` prefix blocks, which leave the free pool if no one holds them)."""
        taken = sum(1 for block in cached if self._refs[block] == 0)
        return (
            self._blocks_missing(seq, num_new_tokens, len(cached)) + taken <= self.num_free_blocks
        )

    def allocate(self, seq: HasBlockTable, num_new_tokens: int, cached: Sequence[int] = ()) -> None:
        """Share the `cached` prefix blocks (from `find_cached`, for a sequence without KV),
        then grow `seq.block_table` so that positions < computed + new have a home."""
        if not self.can_allocate(seq, num_new_tokens, cached):
            raise RuntimeError(
                f"out of KV blocks: need {self._blocks_missing(seq, num_new_tokens, len(cached))}, "
                f"{self.num_free_blocks} free (call can_allocate first)"
            )
        if cached:
            if seq.block_table or seq.num_computed_tokens:
                raise RuntimeError("cached prefix blocks are for a sequence without KV")
            for block in cached:
                if self._refs[block] == 0:
                    del self._evictable[block]
                self._refs[block] += 1
            seq.block_table.extend(cached)
            seq.num_cached_blocks = len(cached)
            seq.num_computed_tokens = len(cached) * self.block_size
        for _ in range(self._blocks_missing(seq, num_new_tokens, 0)):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        if self._plain:
            block = self._plain.popleft()
        else:  # evict the least recently freed cached block
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
        self._refs[block] = 1
        return block

    def can_append(self, seq: HasBlockTable) -> bool:
        """Whether one decode token more fits."""
        return self.can_allocate(seq, 1)

    def append(self, seq: HasBlockTable) -> None:
        self.allocate(seq, 1)

    def free(self, seq: HasBlockTable) -> None:
        """Drop `seq`'s reference on each of its blocks; the sequence keeps no KV. A block no one
        holds any more stays in the prefix cache if it is cached, else goes back to the free list."""
        # Last block first: a sequence's tail is the least likely part to be shared, so it is
        # evicted first; plain blocks go to the front of the free list (warm in the CPU cache).
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if self._hash[block] is not None:
                    self._evictable[block] = None
                else:
                    self._plain.appendleft(block)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0

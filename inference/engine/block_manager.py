"""Paged KV-cache bookkeeping: fixed-size blocks handed out from a free list.

Plain Python, no tensors: the block manager only decides *which* physical blocks a
sequence owns; the model runner turns a sequence's block table into slot indices.
Ask-then-act pairs (`can_allocate`/`allocate`, `can_append`/`append`) let the
scheduler check capacity before it commits to a decision.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol


class HasBlockTable(Protocol):
    """What the block manager needs to know about a sequence."""

    block_table: list[int]
    num_computed_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    # -- capacity -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _blocks_missing(self, seq: HasBlockTable, num_new_tokens: int) -> int:
        needed = self.blocks_for_tokens(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    # -- ask / act --------------------------------------------------------------
    def can_allocate(self, seq: HasBlockTable, num_new_tokens: int) -> bool:
        """Whether `num_new_tokens` more tokens of `seq` fit in its blocks plus free ones."""
        return self._blocks_missing(seq, num_new_tokens) <= len(self._free)

    def allocate(self, seq: HasBlockTable, num_new_tokens: int) -> None:
        """Grow `seq.block_table` so that positions < computed + new have a home."""
        missing = self._blocks_missing(seq, num_new_tokens)
        if missing > len(self._free):
            raise RuntimeError(
                f"out of KV blocks: need {missing}, {len(self._free)} free (call can_allocate first)"
            )
        seq.block_table.extend(self._free.popleft() for _ in range(missing))

    def can_append(self, seq: HasBlockTable) -> bool:
        """Whether one decode token more fits."""
        return self.can_allocate(seq, 1)

    def append(self, seq: HasBlockTable) -> None:
        self.allocate(seq, 1)

    def free(self, seq: HasBlockTable) -> None:
        """Return every block of `seq` to the free list; the sequence keeps no KV."""
        # Freed blocks go to the front: they are warm in the CPU cache.
        self._free.extendleft(reversed(seq.block_table))
        seq.block_table.clear()
        seq.num_computed_tokens = 0

"""Host memory for adapter weights: large blocks reused from load to load.

A cold adapter's weights land in a large block twice on a CPU: the file's read buffer
(`validation.read_weights`) and, when a slot is reused, the victim's copy out of it
(`LoRASlots.unshare`). Memory fresh from the OS costs a page fault per page on first touch, and
in a virtual machine whose host backs guest memory lazily (and takes back what the guest frees)
that is ~2.3 ms per MiB: 9 MiB of fresh buffer took 22 ms of faults in the engine, against 0.3
ms for memory the process had touched before (2-core AMD EPYC VM). So blocks are kept: one that
nothing references any more goes back to `BLOCKS` and the next load of a similar size reuses it,
already faulted in. While the pool grows (the host tier filling up), each new block it has to
hand out makes it fault in a spare of that size on a thread of its own, off the next cold
request's path. New blocks are whole huge pages, anonymous mappings advised MADV_HUGEPAGE (2
MiB per fault where the OS has transparent huge pages; elsewhere the advice is a no-op).

    data = BLOCKS.take(nbytes)          # len(data) >= nbytes; zeros only when new
    arena = HostArena(HostArena.nbytes_for([((16, 576), torch.bfloat16), ...]))
    a = arena.empty((16, 576), torch.bfloat16)     # one block for several tensors
    b = arena.copy(slot_rows, torch.bfloat16)

A block is free when no Python object refers to it but the pool: a tensor or numpy array made
over it (torch.frombuffer, np.frombuffer) or a memoryview holds a reference, so a block is never
handed out while anything can still read or write it.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading

import torch

ALIGN = 64  # bytes: every tensor carved from an arena starts on a cache line
HUGE_PAGE = 2 << 20


def new_block(nbytes: int) -> mmap.mmap | bytearray:
    """A zero-filled writable block of `nbytes` rounded up to whole huge pages, straight from
    the OS and advised to use them (a bytearray where anonymous mappings are unavailable)."""
    nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return bytearray(nbytes)
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            block.madvise(advice)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass
    return block


class BlockPool:
    """Blocks handed out by `take` and reused once nothing refers to them; at most `max_idle`
    free blocks are kept (the rest go back to the OS when the pool next looks: a `take`, or a
    memory report through `idle_bytes`). Requests under
    `min_bytes` get a new bytearray each time: malloc's own free lists serve those well.
    `spares`: fault in a spare block whenever a new one had to be handed out."""

    def __init__(self, max_idle: int = 2, min_bytes: int = 1 << 20, spares: bool = True) -> None:
        self.max_idle = max_idle
        self.min_bytes = min_bytes
        self.spares = spares
        self._blocks: list[mmap.mmap | bytearray] = []  # every block handed out and not yet dropped
        self._lock = threading.Lock()
        self._making_spare = False

    def take(self, nbytes: int) -> mmap.mmap | bytearray:
        """A writable block of at least `nbytes` that nothing else refers to: a free one of a
        close size (at most twice `nbytes` plus a huge page) or a new one. Its contents are
        whatever its last user left: write before reading."""
        if nbytes < self.min_bytes:
            return bytearray(nbytes)
        with self._lock:
            free = self._free()
            fits = [i for i in free if nbytes <= len(self._blocks[i]) <= 2 * nbytes + HUGE_PAGE]
            chosen = min(fits, key=lambda i: len(self._blocks[i]), default=None)
            block = new_block(nbytes) if chosen is None else self._blocks[chosen]
            self._drop([i for i in free if i != chosen][self.max_idle :] + ([] if chosen is None else [chosen]))
            self._blocks.append(block)  # (the chosen one moves to the end: in use)
            if chosen is None and self.spares and self.max_idle and not self._making_spare:
                self._making_spare = True
                threading.Thread(target=self._add_spare, args=(len(block),), name="lora-block", daemon=True).start()
            return block

    def _add_spare(self, nbytes: int) -> None:
        try:
            block = new_block(nbytes)
            _fault_in(block)
            with self._lock:
                self._blocks.append(block)
        finally:
            self._making_spare = False

    def idle_bytes(self) -> int:
        """Bytes of the free blocks the pool keeps, once those beyond `max_idle` are dropped
        (blocks freed since the last `take`, an adapter removed say, are found here too)."""
        with self._lock:
            free = self._free()
            kept = sum(len(self._blocks[i]) for i in free[: self.max_idle])
            self._drop(free[self.max_idle :])
            return kept

    def _free(self) -> list[int]:
        """Indices of the blocks nothing but the pool refers to (under the lock)."""
        return [i for i in range(len(self._blocks)) if _unreferenced(self._blocks, i)]

    def _drop(self, indices: list[int]) -> None:
        """Forget the blocks at `indices` (under the lock); one nothing else holds is unmapped."""
        gone = set(indices)
        self._blocks = [b for i, b in enumerate(self._blocks) if i not in gone]


def _unreferenced(blocks: list, i: int) -> bool:
    # The references sys.getrefcount sees for a block only `blocks` holds: the list's, the
    # argument's. A tensor, array or memoryview over it adds one (its buffer export), and so
    # does any name bound to it (hence no loop variable over the blocks in the callers).
    return sys.getrefcount(blocks[i]) <= 2


def _fault_in(block: mmap.mmap | bytearray) -> None:
    """Touch every page of `block` now (memset through ctypes: the GIL is released while the
    kernel faults the pages in)."""
    pointer = ctypes.c_char.from_buffer(block)  # an export of `block`, dropped on return
    ctypes.memset(ctypes.addressof(pointer), 0, len(block))


BLOCKS = BlockPool()


class HostArena:
    """Tensors carved one after another from one pooled block, each 64-byte aligned. Size it
    with `HostArena.nbytes_for` over the shapes it will hold."""

    def __init__(self, nbytes: int, pool: BlockPool | None = None) -> None:
        self._buffer = (BLOCKS if pool is None else pool).take(nbytes)
        self._size = nbytes  # what it was sized for (the block may be larger)
        self._offset = 0

    @staticmethod
    def nbytes_for(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> int:
        return sum(_padded(math.prod(shape) * dtype.itemsize) for shape, dtype in shapes)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` over the arena's next bytes (contents undefined)."""
        count = math.prod(shape)
        start = self._offset
        if start + count * dtype.itemsize > self._size:
            raise ValueError(f"arena of {self._size} bytes cannot hold {shape} {dtype} at {start}")
        self._offset = start + _padded(count * dtype.itemsize)
        return tensor_over(self._buffer, dtype, shape, start)

    def copy(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous copy of `src` in `dtype`, in the arena."""
        return self.empty(tuple(src.shape), dtype).copy_(src)


def tensor_over(buffer: mmap.mmap | bytearray, dtype: torch.dtype, shape: tuple[int, ...], offset: int) -> torch.Tensor:
    """A contiguous tensor of `shape` over `buffer`'s bytes from `offset` on (no copy), holding
    the buffer through its storage alone. Not a `.view()` of a flat tensor: a view keeps its base
    alive, so `set_` pointing it elsewhere (LoRASlots.share) would still hold the whole block,
    and a shared adapter's block would never come back to the pool. An empty shape holds
    nothing (torch.frombuffer refuses a count of 0)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)  # storage = those bytes
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, shape)


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN

"""Two-tier adapter cache: device slots over a host LRU over disk.

    disk/remote ──load + validate (background thread)──▶ host LRU (max_cpu_loras)
    host ──copy into a preallocated slot (on_activate callback)──▶ device slots (max_loras)

Plain Python over opaque adapter objects (anything with `.id` and `.nbytes`), so it is
tested without tensors; the adapter manager (manager.py) supplies `load` (disk → validated host
adapter) and `on_activate(slot, adapter)` / `on_deactivate(slot)` (host → device copy).

Rules (the design's, made checkable):
- Identity is the immutable adapter id: a re-uploaded adapter is a new id, never a hit on the old.
- Load and validate *before* evicting: a failed load leaves both tiers exactly as they were.
- Loads run off the caller's thread; concurrent requests for one cold adapter load it once.
- Pinned adapters are never evicted from either tier; at most `max_loras - 1` are pinned so
  that some slot stays free for everyone else.
- A slot in use by running sequences (refcount > 0) is never evicted.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol


class CachedAdapter(Protocol):
    id: str
    nbytes: int


class Tier(enum.StrEnum):
    DEVICE = "device"
    HOST = "host"
    LOADING = "loading"
    DISK = "disk"  # registered, not in memory
    FAILED = "failed"


@dataclass
class AdapterEntry:
    """What the cache knows about one adapter id, resident or not."""

    id: str
    source: Any  # whatever `load` needs (a path, a request object)
    pinned: bool = False
    hits: int = 0
    last_used: float | None = None
    load_seconds: float | None = None
    error: str | None = None
    future: Future | None = field(default=None, repr=False)


@dataclass
class CacheStats:
    hits: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    misses: int = 0  # had to go to disk
    loads: int = 0
    load_failures: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0})
    load_seconds: list[float] = field(default_factory=list)

    def as_dict(self) -> dict:
        """A copy safe to hand to another thread."""
        return {
            "hits": dict(self.hits),
            "misses": self.misses,
            "loads": self.loads,
            "load_failures": self.load_failures,
            "evictions": dict(self.evictions),
            "load_seconds": list(self.load_seconds),
        }


class AdapterCache:
    def __init__(
        self,
        *,
        max_loras: int,
        max_cpu_loras: int,
        load: Callable[[Any], CachedAdapter],
        on_activate: Callable[[int, CachedAdapter], None] = lambda slot, adapter: None,
        on_deactivate: Callable[[int], None] = lambda slot: None,
        executor: ThreadPoolExecutor | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras must be >= max_loras ({max_loras}), got {max_cpu_loras}")
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self._load = load
        self._on_activate = on_activate
        self._on_deactivate = on_deactivate
        self._executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._clock = clock
        self._lock = threading.RLock()
        self.entries: dict[str, AdapterEntry] = {}
        # Bumped by every remove(): readers that mirror `entries` (the prefix cache's blocks per
        # adapter) re-check only when it moved, not on every engine step.
        self.removals = 0
        self.host: OrderedDict[str, CachedAdapter] = OrderedDict()  # LRU: oldest first
        self.slots: list[str | None] = [None] * max_loras
        self.slot_refs: list[int] = [0] * max_loras
        self._slot_used: list[float] = [0.0] * max_loras
        self.stats = CacheStats()

    # -- registry -------------------------------------------------------------------
    def register(self, adapter_id: str, source: Any) -> AdapterEntry:
        with self._lock:
            entry = self.entries.get(adapter_id)
            if entry is None:
                entry = self.entries[adapter_id] = AdapterEntry(adapter_id, source)
            return entry

    def tier(self, adapter_id: str) -> Tier:
        with self._lock:
            entry = self.entries.get(adapter_id)
            if entry is None:
                raise KeyError(adapter_id)
            if adapter_id in self.slots:
                return Tier.DEVICE
            if adapter_id in self.host:
                return Tier.HOST
            if entry.future is not None and not entry.future.done():
                return Tier.LOADING
            return Tier.FAILED if entry.error else Tier.DISK

    # -- host tier: load in the background ----------------------------------------
    def prefetch(self, adapter_id: str, *, count_miss: bool = False) -> Future:
        """Make sure the adapter is (or is being) loaded into the host tier; returns the load's
        future (its result None: the entry keeps it, and a finished future must not keep the
        adapter in memory once the host tier evicts it). count_miss: a request is waiting for it
        (an early prefetch as it is queued), so a load started here is that request's miss
        (`acquire` then finds it loading or loaded)."""
        with self._lock:
            entry = self.entries[adapter_id]
            if adapter_id in self.host:
                done: Future = Future()
                done.set_result(None)
                return done
            # Never loaded, or loaded once and since evicted from the host: (re)load. A failed
            # load stays failed (its error is on the entry) until the adapter is removed.
            if entry.future is None or (entry.future.done() and entry.error is None):
                entry.future = self._executor.submit(self._load_into_host, entry)
                self.stats.misses += count_miss
            return entry.future

    def load_new(self, source: Any) -> Future:
        """Load an adapter whose id is not known yet (a name and path just added): on success it
        is registered under its content id and placed in the host tier. Returns the future."""
        return self._executor.submit(self._load_new, source)

    def _load_new(self, source: Any) -> CachedAdapter:
        start = self._clock()
        try:
            adapter = self._load(source)
        except Exception:
            with self._lock:
                self.stats.load_failures += 1
            raise
        seconds = self._clock() - start
        with self._lock:
            entry = self.register(adapter.id, source)
            entry.error = None
            if adapter.id in self.host:  # the same content under another name: one copy
                self.host.move_to_end(adapter.id)
                return self.host[adapter.id]
            self._make_host_room()
            self.host[adapter.id] = adapter
            entry.load_seconds = seconds
            self.stats.loads += 1
            self.stats.load_seconds.append(seconds)
            return adapter

    def _load_into_host(self, entry: AdapterEntry) -> None:
        start = self._clock()
        try:
            adapter = self._load(entry.source)  # disk read + validation, off the step loop
        except Exception as exc:  # a bad adapter is reported on its entry, never disturbs others
            with self._lock:
                entry.error = str(exc)
                self.stats.load_failures += 1
            raise
        seconds = self._clock() - start
        with self._lock:
            if adapter.id != entry.id:
                entry.error = f"loaded adapter has id {adapter.id!r}, expected {entry.id!r}"
                self.stats.load_failures += 1
                raise ValueError(entry.error)
            self._make_host_room()
            self.host[entry.id] = adapter
            entry.load_seconds = seconds
            self.stats.loads += 1
            self.stats.load_seconds.append(seconds)

    def _make_host_room(self) -> None:
        """Evict least recently used host entries that are neither pinned nor in a slot, until one
        more fits. If every entry is pinned or active the tier runs over capacity rather than
        failing a good adapter (slots + pins can outnumber a small max_cpu_loras)."""
        while len(self.host) >= self.max_cpu_loras:
            victim = next(
                (i for i in self.host if not self.entries[i].pinned and i not in self.slots), None
            )
            if victim is None:
                return
            del self.host[victim]
            self.stats.evictions["host"] += 1

    # -- device tier: slots ----------------------------------------------------------
    def acquire(self, adapter_id: str) -> int | None:
        """A slot holding the adapter, its refcount taken; None if it isn't loaded yet or no slot
        can be freed now (the caller keeps the request waiting and starts a load)."""
        with self._lock:
            entry = self.entries[adapter_id]
            now = self._clock()
            if adapter_id in self.slots:
                slot = self.slots.index(adapter_id)
                self.stats.hits["device"] += 1
            elif adapter_id in self.host:
                slot = self._free_slot()
                if slot is None:
                    return None
                adapter = self.host[adapter_id]
                self._on_activate(slot, adapter)
                self.slots[slot] = adapter_id
                self.stats.hits["host"] += 1
            else:
                if entry.future is None or entry.future.done():  # one miss per load, not per retry
                    self.stats.misses += 1
                self.prefetch(adapter_id)
                return None
            self.host.move_to_end(adapter_id)
            self.slot_refs[slot] += 1
            self._slot_used[slot] = now
            entry.hits += 1
            entry.last_used = now
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            if self.slot_refs[slot] <= 0:
                raise RuntimeError(f"slot {slot} released more often than acquired")
            self.slot_refs[slot] -= 1

    def next_victim(self) -> int | None:
        """The slot the next adapter to need one would empty if it came now (the least recently
        used one no running sequence holds and no pin keeps), or None: a slot is free, or none
        can be emptied."""
        with self._lock:
            if None in self.slots:
                return None
            candidates = [
                s for s, aid in enumerate(self.slots)
                if self.slot_refs[s] == 0 and not self.entries[aid].pinned
            ]
            return min(candidates, key=lambda s: self._slot_used[s], default=None)  # least recently used

    def _free_slot(self) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        slot = self.next_victim()
        if slot is None:
            return None
        self._on_deactivate(slot)
        self.slots[slot] = None
        self.stats.evictions["device"] += 1
        return slot

    # -- pinning and removal -------------------------------------------------------------
    def pin(self, adapter_id: str) -> None:
        with self._lock:
            entry = self.entries[adapter_id]
            pinned = sum(e.pinned for e in self.entries.values() if e.id != adapter_id)
            if not entry.pinned and pinned >= self.max_loras - 1:
                raise ValueError(
                    f"cannot pin {adapter_id!r}: at most max_loras - 1 = {self.max_loras - 1} adapters "
                    "may be pinned, so other adapters can still run"
                )
            entry.pinned = True

    def unpin(self, adapter_id: str) -> None:
        with self._lock:
            self.entries[adapter_id].pinned = False

    def remove(self, adapter_id: str) -> None:
        """Forget an adapter: out of its slot (once no sequence uses it) and the host tier."""
        with self._lock:
            if adapter_id in self.slots:
                slot = self.slots.index(adapter_id)
                if self.slot_refs[slot]:
                    raise RuntimeError(f"adapter {adapter_id!r} is in use by running requests")
                self._on_deactivate(slot)
                self.slots[slot] = None
            self.host.pop(adapter_id, None)
            self.entries.pop(adapter_id, None)
            self.removals += 1

    # -- reporting ---------------------------------------------------------------------
    def describe(self) -> list[dict]:
        with self._lock:
            return [
                {
                    "id": e.id,
                    "tier": str(self.tier(e.id)),
                    "bytes": self.host[e.id].nbytes if e.id in self.host else None,
                    "pinned": e.pinned,
                    "hits": e.hits,
                    "last_used": e.last_used,
                    "load_seconds": e.load_seconds,
                    "error": e.error,
                }
                for e in self.entries.values()
            ]

    def stats_snapshot(self) -> dict:
        with self._lock:
            return self.stats.as_dict()

    def pending_loads(self) -> list[Future]:
        with self._lock:
            return [e.future for e in self.entries.values() if e.future is not None and not e.future.done()]

    @property
    def host_bytes(self) -> int:
        with self._lock:
            return sum(a.nbytes for a in self.host.values())

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

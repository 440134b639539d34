"""The engine's adapter registry: names → immutable adapters, the two-tier cache, the slots.

    name ──▶ AdapterRecord (path, load future, content id)      add / bind / remove / pin
                      │ id
                      ▼
    AdapterCache (host LRU, slot refcounts; loads on its background thread)
                      │ on_activate / on_deactivate
                      ▼
    LoRASlots (stacked weights in every projection of the model)

A request binds to the record its name points to *when it arrives* and keeps it: if the
name is re-added with different weights meanwhile, the request still runs the adapter it
asked for, and nothing keyed by the old id (a slot, a cache entry) serves the new one. A
retired record's adapter leaves the cache once its last request is done.

The engine binds each request to a record (`bind` / `unbind`) and notes where it found the
adapter then (`arrival_tier`: device, host or disk, the request's cold or warm start); the scheduler asks for a slot
when it admits the request and gives it back on preemption or finish (`load_error`,
`acquire` / `release`: the slot protocol of inference/engine/scheduler.py). Which sequence
holds which slot is the scheduler's business: nothing here knows about sequences.

Threads: `add`, `remove`, `pin`, `describe` and the stats may be called from any thread (the
server's event loop); `bind`, `unbind`, the slot protocol and `begin_step` only from the
engine's step thread. Everything that touches slot tensors runs on the step thread: removals
asked from elsewhere are queued and applied at the next `begin_step`, between forwards.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from inference.lora import host_memory
from inference.lora.adapter import LoRAAdapter, LoRAModuleWeights, load_adapter
from inference.lora.cache import AdapterCache, Tier
from inference.lora.request import LoRARequest
from inference.lora.slots import LoRASlots
from inference.models.config import LlamaConfig

MAX_NAME_LENGTH = 128


class AdapterNotFoundError(LookupError):
    """No adapter is registered under that name."""

    def __init__(self, name: str) -> None:
        super().__init__(f"adapter {name!r} is not registered (add it first)")
        self.name = name


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    id: str | None  # content hash; None until the first load finished
    path: str
    tier: str  # device | host | loading | disk | failed
    rank: int | None
    nbytes: int | None  # in memory (None when only on disk)
    pinned: bool
    hits: int
    last_used: float | None  # wall-clock time.time()
    load_seconds: float | None
    error: str | None


@dataclass(eq=False)
class AdapterRecord:
    """One name's adapter as added at one moment: a load in flight, a loaded id, or an error."""

    name: str
    path: Path
    # the load in flight; None once it ended (its result is the adapter, which must be free to
    # leave memory when the host tier evicts it: a finished future would hold it for good)
    future: Future | None = field(repr=False)
    id: str | None = None
    rank: int | None = None
    error: str | None = None
    users: int = 0  # requests bound to it and not finished
    retired: bool = False  # replaced or removed: serves the requests already bound, then goes
    bound_tier: str | None = None  # where the latest bind found the adapter (arrival_tier)

    @property
    def ready(self) -> bool:
        return self.id is not None


class AdapterManager:
    def __init__(
        self,
        model: torch.nn.Module,
        base_config: LlamaConfig,
        *,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        strict_base_match: bool,
        dtype: torch.dtype,
        device: torch.device,
        slot_dtype: torch.dtype | None = None,
    ) -> None:
        """dtype: adapters' weights in host memory; slot_dtype: the device slots' (the matmul
        plan's LoRA compute dtype; default dtype)."""
        self.base_config = base_config
        self.max_lora_rank = max_lora_rank
        self.strict_base_match = strict_base_match
        self.dtype = dtype
        self.device = device
        self.slots = LoRASlots(model, max_loras, max_lora_rank, slot_dtype or dtype, device)
        self.cache = AdapterCache(
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            load=self._load,
            on_activate=self._activate,
            on_deactivate=self._deactivate,
            executor=ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load"),
        )
        self._lock = threading.RLock()
        self._current: dict[str, AdapterRecord] = {}  # name -> the record new requests get
        self._pending: dict[str, AdapterRecord] = {}  # name -> a newer version still loading
        self._retired: list[AdapterRecord] = []
        self._on_step_thread: deque[Callable[[], None]] = deque()
        # On a CPU the host tier shares memory with the slots (slots.share): slot -> the
        # adapter whose tensors are views of it. On CUDA the pinned host copy is the point.
        self._share_slots = device.type == "cpu"
        self._shared: dict[int, LoRAAdapter] = {}

    # -- slot contents (the cache's callbacks, under its lock, on the step thread) -------
    def _activate(self, slot: int, adapter: LoRAAdapter) -> None:
        self.slots.activate(slot, adapter)
        if self._share_slots:  # at the next begin_step: not on this request's first token
            self._on_step_thread.append(lambda: self._share(slot, adapter))

    def _share(self, slot: int, adapter: LoRAAdapter) -> None:
        with self.cache._lock:  # the slot may have changed hands since it was filled
            if self.cache.slots[slot] == adapter.id and slot not in self._shared:
                self.slots.share(slot, adapter)
                self._shared[slot] = adapter

    def _deactivate(self, slot: int) -> None:
        adapter = self._shared.pop(slot, None)
        if adapter is not None:  # its rows are about to be reused: the host tier keeps a copy
            self.slots.unshare(slot, adapter)
        # Not zeroed here: the cache empties a slot mostly to refill it at once (a cold
        # adapter's first step), and activate writes every element anyway. A slot still empty
        # at the next step (an adapter removed) is zeroed then, off the request's first token.
        self.slots.deactivate(slot, zero=False)
        self._on_step_thread.append(lambda: self._zero_if_empty(slot))

    def _zero_if_empty(self, slot: int) -> None:
        with self.cache._lock:
            if self.cache.slots[slot] is None:
                self.slots.zero(slot)

    # -- loading -------------------------------------------------------------------------
    def _load(self, source: tuple[Path, str]) -> LoRAAdapter:
        """Disk → validated host adapter (runs on the cache's loader thread)."""
        path, name = source
        adapter = load_adapter(
            path, name, self.base_config, self.max_lora_rank, self.strict_base_match, self.dtype
        )
        if self.device.type == "cuda":  # page-locked host copies make the slot copy asynchronous
            pinned = {
                key: LoRAModuleWeights(a=w.a.pin_memory(), b=w.b.pin_memory(), scale=w.scale)
                for key, w in adapter.weights.items()
            }
            adapter = dataclasses.replace(adapter, weights=MappingProxyType(pinned))
        return adapter

    def add(self, name: str, path: str | Path, pin: bool = False) -> Future:
        """Validate and load `path` under `name` in the background; returns a Future of its
        AdapterInfo, failing with AdapterError. The name switches to the new adapter only
        once it loaded: a bad adapter leaves the one already served untouched."""
        return self._start_load(name, path, pin)[1]

    def _start_load(self, name: str, path: str | Path, pin: bool) -> tuple[AdapterRecord, Future]:
        check_name(name)
        record = AdapterRecord(name=name, path=Path(path), future=None)
        done: Future = Future()
        with self._lock:
            self._pending[name] = record
            record.future = load = self.cache.load_new((record.path, name))
        # (A fast failure may run the callback right here, before this returns.)
        load.add_done_callback(lambda f: self._on_loaded(record, f, pin, done))
        return record, done

    def _on_loaded(self, record: AdapterRecord, future: Future, pin: bool, done: Future) -> None:
        exc = future.exception()
        with self._lock:
            record.future = None
            if self._pending.get(record.name) is record:
                del self._pending[record.name]
            if exc is not None:
                record.error = str(exc)
                record.retired = True
            else:
                adapter = future.result()
                record.id, record.rank = adapter.id, adapter.rank
                old = self._current.get(record.name)
                self._current[record.name] = record
                if old is not None and old is not record:
                    self._retire(old)
                if pin:
                    try:
                        self.cache.pin(record.id)
                    except ValueError as pin_error:
                        exc = pin_error
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(self._info(record))

    # -- registry --------------------------------------------------------------------------
    def remove(self, name: str) -> None:
        """Stop serving `name` to new requests; requests already bound to it finish first."""
        with self._lock:
            record = self._current.pop(name, None)
            pending = self._pending.pop(name, None)
            if record is None and pending is None:
                raise AdapterNotFoundError(name)
            for r in (record, pending):
                if r is not None:
                    self._retire(r)

    def pin(self, name: str, pinned: bool = True) -> None:
        with self._lock:
            record = self._current.get(name)
            if record is None:
                raise AdapterNotFoundError(name)
            if pinned:
                self.cache.pin(record.id)
            else:
                self.cache.unpin(record.id)

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._current or name in self._pending

    def bind(self, lora: str | LoRARequest) -> AdapterRecord:
        """The record a new request for `lora` runs with, one user counted (step thread): a
        registered name's current record, or for a LoRARequest whose name or path is new, a
        record whose background load starts now (the request waits for it). Raises
        AdapterNotFoundError for an unknown name."""
        with self._lock:
            if isinstance(lora, LoRARequest):
                path = Path(lora.path)
                record = next(
                    (r for r in (self._pending.get(lora.name), self._current.get(lora.name))
                     if r is not None and r.path == path),
                    None,
                )  # fmt: skip
                if record is None:
                    record, _ = self._start_load(lora.name, path, pin=False)
                    record.bound_tier = str(Tier.DISK)  # even if its load finishes at once
                    record.users += 1
                    return record
            else:
                record = self._current.get(lora) or self._pending.get(lora)
                if record is None:
                    raise AdapterNotFoundError(lora)
            record.bound_tier = self._tier_now(record)
            record.users += 1
            return record

    def prefetch(self, record: AdapterRecord) -> None:
        """S-LoRA's early prefetch, for a request just bound to `record` (after its arrival_tier
        was noted): an adapter that left host memory starts reloading now, not when the scheduler
        first tries to admit the request (behind a long queue, much later). A failed reload is
        the request's error through `load_error`, as a reload started by `acquire` would be."""
        if record.ready:
            try:
                if self.cache.tier(record.id) is Tier.DISK:
                    self.cache.prefetch(record.id, count_miss=True)
            except KeyError:  # removed from the cache meanwhile (retired): nothing to load
                pass

    def arrival_tier(self, record: AdapterRecord) -> str:
        """Where the request just bound to `record` (the latest `bind`) found its adapter:
        "device" (in a slot), "host" (in host memory: copied into a slot for it) or "disk" (still
        to be read: loading, evicted from host memory, failed, or already removed). Noted by
        `bind` itself: a load it started may finish before this is asked."""
        return record.bound_tier or self._tier_now(record)

    def _tier_now(self, record: AdapterRecord) -> str:
        if not record.ready:
            return str(Tier.DISK)
        try:
            tier = self.cache.tier(record.id)
        except KeyError:  # removed from the cache meanwhile (retired)
            return str(Tier.DISK)
        return str(tier) if tier in (Tier.DEVICE, Tier.HOST) else str(Tier.DISK)

    def unbind(self, record: AdapterRecord) -> None:
        """A request bound to `record` is finished for good (step thread)."""
        with self._lock:
            record.users -= 1
            if record.retired and record.users == 0:
                self._on_step_thread.append(self._drop_retired)

    def _retire(self, record: AdapterRecord) -> None:
        record.retired = True
        self._retired.append(record)
        self._on_step_thread.append(self._drop_retired)

    def _drop_retired(self) -> None:
        """Remove from the cache every retired adapter no request and no live name uses."""
        with self._lock:
            live_ids = {r.id for r in (*self._current.values(), *self._pending.values())}
            keep = []
            for record in self._retired:
                if record.users > 0:
                    keep.append(record)
                elif record.id is not None and record.id not in live_ids and record.id in self.cache.entries:
                    self.cache.remove(record.id)
            self._retired = keep

    # -- the scheduler's slot protocol (step thread) -------------------------------------------
    def load_error(self, record: AdapterRecord) -> str | None:
        """Why `record`'s adapter can never be served (its load failed, or its reload after a
        host eviction did); None while it is loading or loaded."""
        if record.error is not None:
            return record.error
        if record.ready and self.cache.tier(record.id) is Tier.FAILED:
            return self.cache.entries[record.id].error
        return None

    def acquire(self, record: AdapterRecord) -> int | None:
        """A device slot holding `record`'s adapter, with a reference taken; None while it is
        still loading or every slot is held by other running adapters."""
        if not record.ready:
            return None
        return self.cache.acquire(record.id)

    def release(self, slot: int) -> None:
        """Drop one reference on `slot` (its request was preempted or finished)."""
        self.cache.release(slot)

    def cache_id(self, record: AdapterRecord) -> str | None:
        """The immutable id that keys `record`'s KV in the prefix cache; None until loaded."""
        return record.id

    def known_ids(self) -> set[str]:
        """Ids of every adapter the cache still holds or can reload (their cached KV stays valid)."""
        with self._lock:
            return set(self.cache.entries)

    @property
    def removals(self) -> int:
        """How many adapters the cache has forgotten so far (known_ids shrank at most this often)."""
        return self.cache.removals

    def begin_step(self) -> None:
        """Apply what other threads asked for that touches slots (step thread, between forwards)."""
        while self._on_step_thread:
            self._on_step_thread.popleft()()

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to `timeout` s for an adapter load in flight (when only loading requests
        wait), first giving the slot the loaded adapter will take its host copy back meanwhile."""
        futures = self.cache.pending_loads()
        with self._lock:
            futures += [r.future for r in self._pending.values() if r.future is not None]
        if futures:
            self._unshare_next_victim()
            wait_futures(futures, timeout=timeout, return_when="FIRST_COMPLETED")

    def _unshare_next_victim(self) -> None:
        """Copy the rows of the adapter whose slot the next cold adapter will take back into host
        memory now, while its load runs on the loader thread and this one would only wait
        (CPU): its eviction then costs no copy on that adapter's first token. The adapter keeps
        its slot meanwhile and runs from it as before; if it is used again after all, it is held
        twice until it leaves the slot (then with nothing to copy)."""
        if not self._share_slots:
            return
        with self.cache._lock:
            slot = self.cache.next_victim()
            adapter = self._shared.pop(slot, None) if slot is not None else None
            if adapter is not None:
                self.slots.unshare(slot, adapter)

    # -- reporting -----------------------------------------------------------------------------
    def describe(self) -> list[AdapterInfo]:
        with self._lock:
            records = [*self._current.values(), *(r for n, r in self._pending.items() if n not in self._current)]
            return [self._info(r) for r in records]

    def _info(self, record: AdapterRecord) -> AdapterInfo:
        entry = self.cache.entries.get(record.id) if record.id else None
        if record.error is not None:
            tier = Tier.FAILED
        elif entry is None:
            tier = Tier.LOADING
        else:
            tier = self.cache.tier(record.id)
        adapter = self.cache.host.get(record.id) if record.id else None
        last_used = None
        if entry is not None and entry.last_used is not None:  # cache clock is monotonic
            last_used = time.time() - (time.monotonic() - entry.last_used)
        return AdapterInfo(
            name=record.name,
            id=record.id,
            path=str(record.path),
            tier=str(tier),
            rank=record.rank,
            nbytes=adapter.nbytes if adapter is not None else None,
            pinned=bool(entry and entry.pinned),
            hits=entry.hits if entry else 0,
            last_used=last_used,
            load_seconds=entry.load_seconds if entry else None,
            error=record.error or (entry.error if entry else None),
        )

    def stats(self) -> dict:
        return self.cache.stats_snapshot()

    def memory(self) -> dict[str, int]:
        """Bytes of the slot stacks, of host-tier adapters beyond them (a CPU slot's adapter is
        counted once, in the slots: its host entry is views of them), and of the free blocks kept
        for the next loads (host_memory.BLOCKS: the process's, whichever engine freed them)."""
        shared = sum(a.nbytes for a in list(self._shared.values()))
        return {
            "adapter_slots": self.slots.nbytes,
            "host_adapters": max(0, self.cache.host_bytes - shared),
            "adapter_buffers": host_memory.BLOCKS.idle_bytes(),
        }

    def shutdown(self) -> None:
        self.cache.shutdown()


def check_name(name: object) -> None:
    if not isinstance(name, str) or not name.strip():
        raise ValueError("lora_name: must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH or any(c.isspace() or not c.isprintable() for c in name):
        raise ValueError(f"lora_name: {name[:40]!r} must be at most {MAX_NAME_LENGTH} printable characters without spaces")

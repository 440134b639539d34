"""Continuous batching: each step admits what fits and runs prefill chunks and decodes together.

Plain Python over `Sequence` objects and a `BlockManager`; no tensors. One step:

    budget = max_num_batched_tokens
    for seq in running (oldest first):            # keep what is running going
        n = min(seq's uncomputed tokens, budget)  # 1 for decode, a chunk for a long prefill
        while KV blocks for n don't fit: preempt the newest running sequence (recompute later)
        allocate, schedule (seq, n)
    if nothing was preempted:
        for seq in waiting, in the queue's order, while seats (max_num_seqs) and budget:
            share the longest cached prefix of its tokens (same adapter id and cache salt)
            n = min(tokens left after that prefix, budget)   # chunked prefill
            stop at the first sequence whose blocks don't fit (no overtaking for KV)
            finish a sequence whose adapter failed to load (FinishReason.ERROR), alone
            skip a sequence whose adapter has no device slot yet (it is loading, or every
                slot is busy with other adapters): it waits, the others go on
            allocate, schedule (seq, n)

A preempted sequence loses its KV and its slot reference and goes back to the *front* of
the waiting queue; when readmitted it recomputes prompt + output so far, so its output is
unchanged (its own full blocks, still in the prefix cache unless evicted meanwhile, make the
recompute cheap). Since every running sequence holds a reference on its adapter's slot, one
step never runs more distinct adapters than there are slots.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from inference.engine.block_manager import BlockManager, PrefixKey
from inference.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )


class AdapterSlots(Protocol):
    """What the scheduler needs from the adapter manager (inference/lora/manager.py), for a
    sequence's `adapter` (the manager's opaque handle). Ask, then act: `load_error` first."""

    def load_error(self, adapter: Any) -> str | None:
        """Why the adapter can never be served (its load failed); None otherwise."""
        ...

    def acquire(self, adapter: Any) -> int | None:
        """A device slot holding the adapter, with a reference taken; None while it is loading
        or no slot can be freed."""
        ...

    def release(self, slot: int) -> None:
        """Drop one reference on `slot`."""
        ...

    def unbind(self, adapter: Any) -> None:
        """A sequence bound to the adapter is finished for good."""
        ...

    def cache_id(self, adapter: Any) -> str | None:
        """The adapter's immutable id, which keys its KV in the prefix cache; None until loaded."""
        ...


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the sequence, so a token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # finished with FinishReason.ERROR
    admitted: list[Sequence] = field(default_factory=list)  # left the waiting queue this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class FcfsQueue:
    """First come, first served waiting queue (the default admission policy)."""

    def __init__(self) -> None:
        self._items: deque[Sequence] = deque()

    def push(self, seq: Sequence) -> None:
        self._items.append(seq)

    def push_front(self, seq: Sequence) -> None:
        self._items.appendleft(seq)

    def peek(self) -> Sequence:
        return self._items[0]

    def pop(self) -> Sequence:
        return self._items.popleft()

    def remove(self, seq: Sequence) -> None:
        self._items.remove(seq)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._items))  # a snapshot: the scheduler removes as it admits

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """Service accounting hook of the waiting-queue protocol; FCFS keeps no counters."""


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        waiting: FcfsQueue | None = None,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting = waiting if waiting is not None else FcfsQueue()
        self.adapters = adapters
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}

    # -- queue management -----------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_id:
            raise ValueError(f"request_id {seq.request_id!r} is already in the engine")
        if self.block_manager.blocks_for_tokens(seq.num_tokens) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt of {seq.num_tokens} tokens needs more KV cache than the engine has "
                f"({self.block_manager.capacity_tokens} tokens)"
            )
        seq.status = SequenceStatus.WAITING
        self._by_id[seq.request_id] = seq
        self.waiting.push(seq)

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def abort(self, request_id: str) -> Sequence | None:
        """Stop a request wherever it is and free its KV blocks at once."""
        seq = self._by_id.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Called by the engine when a running sequence hits a stop condition."""
        self.running.remove(seq)
        self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.block_manager.free(seq)
        if seq.adapter is not None and self.adapters is not None:
            self._release_slot(seq)
            self.adapters.unbind(seq.adapter)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_id.pop(seq.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    def has_unfinished(self) -> bool:
        return bool(self._by_id)

    # -- the step decision ----------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # 1. Running sequences first (oldest first), preempting the newest when KV runs out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self.block_manager.allocate(seq, n)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
                continue
            break  # `seq` itself was preempted: everything after it already was too

        # 2. Admit waiting sequences, unless this step had to preempt (no room to grow).
        if not out.preempted:
            for seq in self.waiting:  # the queue's iterator tolerates remove() while iterating
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                cached = self._cached_prefix(seq)
                n = seq.num_uncomputed_tokens - len(cached) * self.block_manager.block_size
                if n > budget:
                    if not self.config.enable_chunked_prefill:
                        break
                    n = budget
                if not self.block_manager.can_allocate(seq, n, cached):
                    break
                if seq.adapter is not None and not self._acquire_slot(seq, out):
                    continue
                self.waiting.remove(seq)
                self.block_manager.allocate(seq, n, cached)
                if not seq.num_preemptions:  # a readmission finding its own blocks is no prompt hit
                    seq.num_cached_tokens = seq.num_computed_tokens
                self._set_prefix_key(seq)  # its adapter may have finished loading just now
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, n))
                out.admitted.append(seq)
                budget -= n
        return out

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` may share: same tokens, same adapter id, same cache salt."""
        self._set_prefix_key(seq)
        if seq.wants_prompt_logprobs:
            # Prompt logprobs need the logits of every prompt position and a cached prefix has
            # none: such a request computes its whole prompt (as vLLM); its blocks still join
            # the cache for others.
            return []
        return self.block_manager.find_cached(seq)

    def _set_prefix_key(self, seq: Sequence) -> None:
        """Key `seq`'s KV blocks once its adapter's id is known (until then it neither looks up
        nor registers blocks; it cannot be admitted before its adapter loaded anyway)."""
        if seq.prefix_key is not None:
            return
        adapter_id = None
        if seq.adapter is not None:
            if self.adapters is None:
                return
            adapter_id = self.adapters.cache_id(seq.adapter)
            if adapter_id is None:
                return
        seq.prefix_key = PrefixKey(adapter_id, seq.cache_salt)

    def _acquire_slot(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """True when `seq` now holds a slot for its adapter; a failed adapter finishes it."""
        if self.adapters is None:
            raise RuntimeError(f"request {seq.request_id!r} has an adapter but LoRA is not enabled")
        error = self.adapters.load_error(seq.adapter)
        if error is not None:
            self.waiting.remove(seq)
            seq.error = error
            self._finish(seq, FinishReason.ERROR)
            out.failed.append(seq)
            return False
        slot = self.adapters.acquire(seq.adapter)
        if slot is None:
            return False
        seq.adapter_slot = slot
        return True

    def _release_slot(self, seq: Sequence) -> None:
        if seq.adapter_slot >= 0:
            self.adapters.release(seq.adapter_slot)
            seq.adapter_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """Drop `seq`'s KV (recompute later) and put it back at the front of the queue."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        if seq.adapter is not None and self.adapters is not None:
            self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.push_front(seq)

    def on_step_done(self, scheduled: list[ScheduledSeq]) -> None:
        """Mark the scheduled tokens as computed (their KV is now in the cache; full blocks join
        the prefix cache) and charge them to the admission policy (fair queuing counts the
        service each tenant received)."""
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_computed(s.seq)
            self.waiting.charge(s.seq, s.num_new_tokens)

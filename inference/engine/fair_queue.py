"""Weighted fair waiting queue between tenants: a virtual token counter (VTC) per tenant.

A drop-in for `FcfsQueue` (the waiting-queue protocol: push, push_front, peek, pop, remove,
__len__, __iter__, charge), after S-LoRA's VTC (Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24). Plain Python, no tensors.

Each tenant t has a counter c[t]: the service it has received, in tokens computed for it
divided by the request's weight. Among tenants with waiting requests ("backlogged"), the one
with the smallest counter is served next; within a tenant, first come first served. A tenant
flooding the queue therefore only gets ahead by the service it has already received, and a
tenant with weight 2 gets twice the tokens of one with weight 1 while both are backlogged.

    floor = 0                           # watermark: min c[t] over backlogged tenants (monotone)
    push(seq of tenant t):              # weight must be > 0 (ValueError)
        if t has no waiting requests:   # t becomes active: no credit banked while idle
            c[t] = max(c[t], floor)     # (a tenant we forgot is at floor)
        append seq to queue[t]
    push_front(seq):                    # a preempted sequence: first again within its tenant
        same, but prepend to queue[t]
    order (peek / pop / __iter__):      # what admission would do, charging prompts on a copy
        v = copy of c over backlogged tenants;  heads = each tenant's queue
        repeat: t = argmin over tenants with requests left of (v[t], stamp of head[t])
                yield head[t]; v[t] += head's uncomputed tokens / head.weight
    charge(seq, n):                     # after each step: prefill chunk sizes, 1 per decode
        c[t] = max(c[t], floor) + n / seq.weight     # the max only matters for an idle t
    after any change: floor = max(floor, min c[t] over backlogged tenants)
                      forget idle tenants (no waiting requests) with c[t] <= floor

Ties between equal counters go to the request queued earliest (a per-queue stamp; push_front
stamps below everything), so with every counter equal -- in particular when no request has a
tenant: tenant None is one default tenant -- the order is exactly FCFS.

"Active" is "has waiting requests", as in the paper: a tenant whose last waiting request was
admitted and that comes back later (new request or preempted one) is lifted to the floor, so
time spent idle, or merely decoding while others waited, does not turn into priority later.
When nothing waits the floor stays where it was (the paper lifts to the last tenant to leave).
One refinement over the paper: an idle tenant's counter never reads below the floor, so its
running requests are charged from max(c[t], floor). The paper would let that tenant spend the
slack below the floor on decodes first; we count from the floor, which is what it would be
lifted to anyway, and it is what makes forgetting exact (next paragraph).

Bounded state (keep backlogged tenants + the floor watermark + idle tenants above it): the
floor is the min over backlogged counters and only rises, and an idle tenant reads as
max(c[t], floor), so an idle tenant with c[t] <= floor behaves exactly like one never seen: it
is dropped at no cost (a missing tenant reads as `floor`), which bounds the map by the tenants
active since the floor last moved. Idle tenants above the floor (served more than the
backlogged ones, e.g. still decoding) are kept, since forgetting them would forgive that
surplus, until the floor passes them; if more than `max_idle_tenants` pile up (nothing waits,
so the floor is still) those closest to the floor are dropped first. Memory is therefore
O(backlogged tenants + max_idle_tenants) whatever the number of tenants ever seen, with no
timer: "a while" is "until the backlogged tenants have caught up with it".

Cost: push/push_front/charge O(1) (O(tenants) when the floor moves), peek/pop O(tenants),
remove O(tenant's queue + tenants); __iter__ O(k log tenants) for the first k, after O(n)
C-speed snapshot copies (and a plain copy when only one tenant waits, as without tenant ids).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterator
from numbers import Real

from inference.engine.sequence import Sequence

Tenant = str | None


class FairQueue:
    """Waiting queue ordered by weighted fair queuing between tenants (VTC); FCFS within one."""

    def __init__(self, *, max_idle_tenants: int = 1024) -> None:
        if max_idle_tenants < 0:
            raise ValueError(f"max_idle_tenants must be >= 0, got {max_idle_tenants}")
        self.max_idle_tenants = max_idle_tenants
        self._queues: dict[Tenant, deque[Sequence]] = {}  # backlogged tenants only (non-empty)
        self._counters: dict[Tenant, float] = {}  # backlogged + idle tenants above the floor
        self._stamps: dict[Sequence, int] = {}  # every waiting sequence -> FIFO tie-break stamp
        self._tenant_of: dict[Sequence, Tenant] = {}  # as pushed (seq.tenant might be changed)
        self._floor = 0.0
        self._next_back = 0
        self._next_front = -1

    # -- protocol ---------------------------------------------------------------
    def push(self, seq: Sequence) -> None:
        self._enqueue(seq, front=False)

    def push_front(self, seq: Sequence) -> None:
        self._enqueue(seq, front=True)

    def peek(self) -> Sequence:
        return self._queues[self._next_tenant()][0]

    def pop(self) -> Sequence:
        seq = self.peek()
        self.remove(seq)
        return seq

    def remove(self, seq: Sequence) -> None:
        if seq not in self._stamps:
            raise ValueError(f"sequence {seq.request_id!r} is not in the waiting queue")
        tenant = self._tenant_of.pop(seq)
        del self._stamps[seq]
        queue = self._queues[tenant]
        if queue[0] is seq:  # the common case: admission takes a tenant's head
            queue.popleft()
        else:
            del queue[next(i for i, s in enumerate(queue) if s is seq)]
        if not queue:  # tenant goes idle: the backlogged min may rise
            del self._queues[tenant]
            self._raise_floor()
            self._trim_idle()

    def __len__(self) -> int:
        return len(self._stamps)

    def __iter__(self) -> Iterator[Sequence]:
        """Admission order if each admitted sequence were charged its prompt tokens on admission.

        Lazy, over a snapshot taken when iteration starts: removing sequences from the queue
        while iterating is safe, and a consumer that stops after k sequences pays O(k log
        tenants) plus the C-speed copies, not the simulation of the whole backlog.
        """
        if len(self._queues) <= 1:  # one tenant (always so without tenant ids): plain FCFS
            return iter([s for q in self._queues.values() for s in q])
        return self._simulated_order()

    def _simulated_order(self) -> Iterator[Sequence]:
        queues = [list(q) for q in self._queues.values()]  # snapshot: [tenant][position]
        stamps = dict(self._stamps)
        heap = [
            (self._counters[self._tenant_of[q[0]]], stamps[q[0]], i, 0)
            for i, q in enumerate(queues)
        ]
        heapq.heapify(heap)
        while heap:
            virtual, _, i, j = heap[0]
            queue = queues[i]
            seq = queue[j]
            if j + 1 < len(queue):
                nxt = queue[j + 1]
                heapq.heapreplace(heap, (virtual + _admission_cost(seq), stamps[nxt], i, j + 1))
            else:
                heapq.heappop(heap)
            yield seq

    def charge(self, seq: Sequence, num_tokens: int) -> None:
        """Add `num_tokens` computed for `seq` (prefill chunk or decode) to its tenant's counter."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        if num_tokens == 0:
            return
        tenant = self._tenant_of.get(seq, seq.tenant)
        # Stored counters are >= floor (backlogged: floor is their min; idle ones below it are
        # forgotten), so this is max(c[t], floor) + n / weight.
        old = self._counters.get(tenant, self._floor)
        self._counters[tenant] = old + num_tokens / seq.weight
        if tenant in self._queues:
            if old == self._floor:  # it may have been the backlogged minimum
                self._raise_floor()
        else:
            self._trim_idle()

    # -- introspection (tests, metrics) -----------------------------------------
    def counter(self, tenant: Tenant) -> float:
        """Tenant's virtual token counter as the policy sees it (a forgotten tenant is at the floor)."""
        return self._counters.get(tenant, self._floor)

    @property
    def floor(self) -> float:
        return self._floor

    @property
    def num_tracked_tenants(self) -> int:
        return len(self._counters)

    # -- internals --------------------------------------------------------------
    def _enqueue(self, seq: Sequence, *, front: bool) -> None:
        _check_weight(seq.weight)
        if seq in self._stamps:
            raise ValueError(f"sequence {seq.request_id!r} is already in the waiting queue")
        tenant = seq.tenant
        queue = self._queues.get(tenant)
        if queue is None:  # becomes active: lift to the floor, no credit banked while idle
            queue = self._queues[tenant] = deque()
            self._counters[tenant] = max(self._counters.get(tenant, self._floor), self._floor)
        if front:
            queue.appendleft(seq)
            self._stamps[seq] = self._next_front
            self._next_front -= 1
        else:
            queue.append(seq)
            self._stamps[seq] = self._next_back
            self._next_back += 1
        self._tenant_of[seq] = tenant
        if len(self._queues) == 1:  # first backlogged tenant after an empty queue
            self._raise_floor()

    def _next_tenant(self) -> Tenant:
        if not self._queues:
            raise IndexError("peek from an empty waiting queue")
        return min(
            self._queues, key=lambda t: (self._counters[t], self._stamps[self._queues[t][0]])
        )

    def _raise_floor(self) -> None:
        """floor = max(floor, min counter over backlogged tenants); forget idle tenants below it."""
        if not self._queues:
            return
        low = min(self._counters[t] for t in self._queues)
        if low <= self._floor:
            return
        self._floor = low
        for t in [t for t, c in self._counters.items() if c <= low and t not in self._queues]:
            del self._counters[t]

    def _trim_idle(self) -> None:
        """Keep at most max_idle_tenants idle counters; drop those closest to the floor first."""
        excess = len(self._counters) - len(self._queues) - self.max_idle_tenants
        if excess <= 0:
            return
        idle = sorted(
            (c, i, t) for i, (t, c) in enumerate(self._counters.items()) if t not in self._queues
        )
        for _, _, t in idle[:excess]:
            del self._counters[t]


def _admission_cost(seq: Sequence) -> float:
    # Its prompt (a preempted sequence recomputes prompt + output so far), in weighted tokens.
    return seq.num_uncomputed_tokens / seq.weight


def _check_weight(weight: object) -> None:
    if (
        isinstance(weight, bool)
        or not isinstance(weight, Real)
        or not math.isfinite(weight)
        or weight <= 0
    ):
        raise ValueError(f"weight must be a finite number > 0, got {weight!r}")

"""The in-process quota backend, for a platform running with only Python (no REDIS_URL): the
same algorithm as ADMIT_LUA (redis_backend.py, the reference) with dicts and a lock."""

from __future__ import annotations

import threading

from portal.quotas.limits import (
    CONCURRENCY_RETRY_MS,
    LIMIT_CODES,
    SETTLED_TTL_MS,
    UNLIMITED,
    WINDOW_MS,
    AdmitOutcome,
    Clock,
    Refusal,
    ScopeSpec,
    ScopeState,
    SettleTicket,
    month_counter_ttl_ms,
)
from portal.quotas.runtime import lease_ms


def choose_refusal(candidates: list[Refusal]) -> Refusal | None:
    """The refusal to report: one retrying cannot fix first, then the longest wait, then the first."""
    best = None
    for candidate in candidates:
        if best is None or (candidate.final, candidate.retry_after_ms) > (
            best.final,
            best.retry_after_ms,
        ):
            best = candidate
    return best


def check_scope(
    *,
    index: int,
    limits: list[int],
    state: ScopeState,
    estimated_tokens: int,
    clock: Clock,
    estimated_spend: int = 0,
) -> list[Refusal]:
    """Every limit of one scope the request would break (the same checks as ADMIT_LUA)."""
    rpm, tpm, cap, budget, spend_limit = limits
    window_reset = state.window_start_ms + WINDOW_MS - clock.now_ms
    refusals = []
    if rpm != UNLIMITED and state.requests + 1 > rpm:
        refusals.append(Refusal(index, LIMIT_CODES[0], window_reset, rpm == 0))
    if tpm != UNLIMITED and state.tokens + estimated_tokens > tpm:
        refusals.append(Refusal(index, LIMIT_CODES[1], window_reset, estimated_tokens > tpm))
    if cap != UNLIMITED and state.in_flight + 1 > cap:
        refusals.append(Refusal(index, LIMIT_CODES[2], CONCURRENCY_RETRY_MS, cap == 0))
    if budget != UNLIMITED and state.month_tokens + estimated_tokens > budget:
        refusals.append(Refusal(index, LIMIT_CODES[3], clock.ms_to_next_month, True))
    if spend_limit != UNLIMITED and state.month_spend + estimated_spend > spend_limit:
        refusals.append(Refusal(index, LIMIT_CODES[4], clock.ms_to_next_month, True))
    return refusals


class MemoryQuotaBackend:
    """Counters in dicts, for a platform running with only Python (no REDIS_URL).

    The critical sections never await, so a threading lock is the right tool: it makes each
    admit/settle atomic against other coroutines, other event loops and sync readers alike.
    Limits hold per process only; run one web process without Redis.
    """

    SWEEP_EVERY = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._windows: dict[str, list[int]] = {}  # key -> [start_ms, requests, tokens]
        self._leases: dict[str, dict[str, int]] = {}  # key -> {request_id: expires_ms}
        self._counters: dict[str, list[int]] = {}  # key -> [value, expires_ms]
        self._settled: dict[str, int] = {}  # key -> expires_ms
        self._operations = 0

    def clear(self) -> None:
        with self._lock:
            self._windows.clear()
            self._leases.clear()
            self._counters.clear()
            self._settled.clear()

    async def admit(
        self, *, scopes: tuple[ScopeSpec, ...], request_id: str, estimated_tokens: int, clock: Clock,
        estimated_spend: int = 0,
    ) -> AdmitOutcome:
        with self._lock:
            self._maybe_sweep(clock.now_ms)
            states = [self._read(scope, clock) for scope in scopes]
            refusals = []
            for index, (scope, state) in enumerate(zip(scopes, states, strict=True)):
                refusals += check_scope(
                    index=index,
                    limits=scope.limit_args(),
                    state=state,
                    estimated_tokens=estimated_tokens,
                    clock=clock,
                    estimated_spend=estimated_spend,
                )
            refusal = choose_refusal(refusals)
            if refusal is not None:
                return AdmitOutcome(tuple(states), refusal)
            return AdmitOutcome(
                tuple(
                    self._take(scope, state, request_id, estimated_tokens, clock, estimated_spend)
                    for scope, state in zip(scopes, states, strict=True)
                ),
                None,
            )

    async def settle(self, *, ticket: SettleTicket, actual_tokens: int, clock: Clock, actual_spend: int = 0) -> bool:
        now = clock.now_ms
        delta = actual_tokens - ticket.estimated_tokens
        spend_delta = actual_spend - ticket.estimated_spend
        with self._lock:
            if self._settled.get(ticket.settled_key, 0) > now:
                return False
            self._settled[ticket.settled_key] = now + SETTLED_TTL_MS
            for prefix, window_start in ticket.scopes:
                self._leases.get(f"{prefix}:inflight", {}).pop(ticket.request_id, None)
                spent = self._counters.get(f"{prefix}:spend:{ticket.month}")
                if spend_delta and spent is not None and spent[1] > now:
                    spent[0] = max(0, spent[0] + spend_delta)
                if delta == 0:
                    continue
                window = self._windows.get(f"{prefix}:window")
                if window is not None and window[0] == window_start:
                    window[2] = max(0, window[2] + delta)
                counter = self._counters.get(f"{prefix}:month:{ticket.month}")
                if counter is not None and counter[1] > now:
                    counter[0] = max(0, counter[0] + delta)
            return True

    def snapshot(self, *, scope: ScopeSpec, clock: Clock) -> ScopeState:
        with self._lock:
            return self._read(scope, clock)

    def _read(self, scope: ScopeSpec, clock: Clock) -> ScopeState:
        now = clock.now_ms
        window = self._windows.get(scope.window_key())
        if window is None or now >= window[0] + WINDOW_MS:
            start, requests, tokens = now, 0, 0
        else:
            start, requests, tokens = window
        leases = self._leases.get(scope.lease_key(), {})
        for request_id in [rid for rid, expires in leases.items() if expires <= now]:
            del leases[request_id]
        counter = self._counters.get(scope.month_key(clock.month))
        month_tokens = counter[0] if counter is not None and counter[1] > now else 0
        spent = self._counters.get(scope.spend_key(clock.month))
        month_spend = spent[0] if spent is not None and spent[1] > now else 0
        return ScopeState(start, requests, tokens, len(leases), month_tokens, month_spend)

    def _take(
        self, scope: ScopeSpec, state: ScopeState, request_id: str, tokens: int, clock: Clock, spend: int
    ) -> ScopeState:
        now = clock.now_ms
        taken = ScopeState(
            state.window_start_ms,
            state.requests + 1,
            state.tokens + tokens,
            state.in_flight + 1,
            state.month_tokens + tokens,
            state.month_spend + spend,
        )
        self._windows[scope.window_key()] = [taken.window_start_ms, taken.requests, taken.tokens]
        self._leases.setdefault(scope.lease_key(), {})[request_id] = now + lease_ms()
        self._counters[scope.month_key(clock.month)] = [
            taken.month_tokens,
            now + month_counter_ttl_ms(clock),
        ]
        self._counters[scope.spend_key(clock.month)] = [taken.month_spend, now + month_counter_ttl_ms(clock)]
        return taken

    def _maybe_sweep(self, now: int) -> None:
        self._operations += 1
        if self._operations % self.SWEEP_EVERY:
            return
        self._windows = {k: w for k, w in self._windows.items() if now < w[0] + WINDOW_MS}
        self._leases = {
            k: live
            for k, leases in self._leases.items()
            if (live := {rid: exp for rid, exp in leases.items() if exp > now})
        }
        self._counters = {k: c for k, c in self._counters.items() if c[1] > now}
        self._settled = {k: exp for k, exp in self._settled.items() if exp > now}

"""The plain data both quota backends work on: no Django, no Redis.

A request is checked against one or two *scopes* (the tenant, and the API key when the key has
its own Quota row). Each scope has four limits (None = unlimited) and three counters:

- a 60 s window {start, requests, tokens}, opened by the first request after the last one
  expired (a fixed window anchored at first use: the reset time is exact and two gateways can
  never disagree on it);
- the in-flight requests, one member per request scored by the time its lease runs out, so a
  slot held by a crashed gateway frees itself;
- the tokens taken this UTC calendar month;
- the money spent this UTC calendar month, in SPEND_UNITS (nano-USD) priced by the tenant's plan.

Estimated tokens (and their estimated cost) are taken at admission and corrected to the actual
usage at settlement.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import ROUND_CEILING, Decimal

wall_clock = time.time  # the one clock of the quota code; tests replace it
WINDOW_MS = 60_000
UNLIMITED = -1  # how a None limit travels to the Lua script
SETTLED_TTL_MS = 86_400_000  # how long a settled admission is remembered (idempotent settle)
CONCURRENCY_RETRY_MS = 1000  # a slot frees when some request ends; nothing better to promise

REQUESTS_PER_MINUTE = "requests_per_minute"
TOKENS_PER_MINUTE = "tokens_per_minute"
MAX_CONCURRENT_REQUESTS = "max_concurrent_requests"
MONTHLY_TOKEN_BUDGET = "monthly_token_budget"
MONTHLY_SPEND_LIMIT = "monthly_spend_limit"
# Codes the Lua script returns for a refusal, in the same order.
LIMIT_CODES = (REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, MAX_CONCURRENT_REQUESTS, MONTHLY_TOKEN_BUDGET,
               MONTHLY_SPEND_LIMIT)
# Limits a refusal of which means the month's allowance is spent (OpenAI's insufficient_quota).
MONTHLY_LIMITS = (MONTHLY_TOKEN_BUDGET, MONTHLY_SPEND_LIMIT)
# Money is counted in whole nano-USD: exact for any price per 1M tokens with up to 3 decimals,
# and 2^63 of them is 9 billion USD, so a Redis integer counter never overflows.
SPEND_UNITS_PER_USD = 10**9


def spend_units(amount: Decimal) -> int:
    """An amount in USD as whole spend units, rounded up (a fraction of a unit is still spent)."""
    return int((Decimal(amount) * SPEND_UNITS_PER_USD).to_integral_value(rounding=ROUND_CEILING))


def spend_amount(units: int) -> Decimal:
    """Spend units back to USD (exact)."""
    return Decimal(units) / SPEND_UNITS_PER_USD


@dataclass(frozen=True)
class ScopeSpec:
    """One level of limits and where its counters live."""

    scope: str  # "tenant" | "key"
    label: str  # for messages: "tenant 'acme'", "API key 'ci' (sk-ab12cd34…)"
    prefix: str  # key prefix of this scope's counters, e.g. "loraplex:quota:{t7}:tenant"
    requests_per_minute: int | None
    tokens_per_minute: int | None
    max_concurrent_requests: int | None
    monthly_token_budget: int | None
    monthly_spend_limit: Decimal | None = None  # USD

    def window_key(self) -> str:
        return f"{self.prefix}:window"

    def lease_key(self) -> str:
        return f"{self.prefix}:inflight"

    def month_key(self, month: str) -> str:
        return f"{self.prefix}:month:{month}"

    def spend_key(self, month: str) -> str:
        return f"{self.prefix}:spend:{month}"

    def limit_args(self) -> list[int]:
        return [
            UNLIMITED if value is None else value
            for value in (
                self.requests_per_minute,
                self.tokens_per_minute,
                self.max_concurrent_requests,
                self.monthly_token_budget,
            )
        ] + [UNLIMITED if self.monthly_spend_limit is None else spend_units(self.monthly_spend_limit)]


@dataclass(frozen=True)
class ScopeState:
    """A scope's counters: after the take when admitted, as found when refused."""

    window_start_ms: int
    requests: int
    tokens: int
    in_flight: int
    month_tokens: int
    month_spend: int = 0  # spend units (nano-USD)


@dataclass(frozen=True)
class Refusal:
    scope_index: int  # into the scopes passed to admit
    limit: str  # one of LIMIT_CODES
    retry_after_ms: int
    final: bool  # retrying soon cannot help (budget spent, or the request alone exceeds a limit)


@dataclass(frozen=True)
class AdmitOutcome:
    states: tuple[ScopeState, ...]
    refusal: Refusal | None  # None: admitted, everything taken; else nothing was taken


@dataclass(frozen=True)
class SettleTicket:
    """What settle needs to undo or correct an admission's takes, in either backend."""

    request_id: str
    settled_key: str
    estimated_tokens: int
    month: str
    scopes: tuple[tuple[str, int], ...]  # (scope prefix, window start the estimate went into)
    estimated_spend: int = 0  # spend units taken at admission


@dataclass(frozen=True)
class Clock:
    """One instant as the quota code needs it."""

    now_ms: int

    @classmethod
    def at(cls, timestamp: float) -> Clock:
        return cls(int(timestamp * 1000))

    @classmethod
    def now(cls) -> Clock:
        return cls.at(wall_clock())

    @property
    def month(self) -> str:
        return self.datetime.strftime("%Y-%m")

    @property
    def datetime(self) -> datetime:
        return datetime.fromtimestamp(self.now_ms / 1000, tz=UTC)

    @property
    def next_month(self) -> datetime:
        now = self.datetime
        year, month = (now.year + 1, 1) if now.month == 12 else (now.year, now.month + 1)
        return datetime(year, month, 1, tzinfo=UTC)

    @property
    def ms_to_next_month(self) -> int:
        return max(1, int(self.next_month.timestamp() * 1000) - self.now_ms)


def month_counter_ttl_ms(clock: Clock) -> int:
    """Keep a month's counter until 35 days after it ends (dashboards compare with last month)."""
    return clock.ms_to_next_month + 35 * 86_400_000


def format_duration(ms: int) -> str:
    """OpenAI's x-ratelimit-reset-* format (Go durations): "350ms", "6s", "1m2s", "1h0m5s"."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    seconds = math.ceil(ms / 1000)
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def retry_after_seconds(ms: int) -> int:
    return max(1, math.ceil(ms / 1000))

"""Monthly statements: the ledger's tokens per model, priced by the tenant's plan.

Amounts are exact Decimals (USD) all the way through; they are rounded to cents only when
shown (`money`), and a total is the rounded exact sum, never a sum of rounded lines.
Prices are the tenant's current plan's (portal.tenants.plans), per 1M tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal, localcontext

from django.db.models import Count, Sum

from portal.tenants.models import Tenant
from portal.tenants.plans import plan_for
from portal.usage.models import UsageRecord
from portal.usage.periods import month_bounds

MILLION = Decimal(1_000_000)
CENT = Decimal("0.01")


def token_cost(tokens: int, price_per_million: Decimal) -> Decimal:
    """Exact cost of `tokens` at `price_per_million` (no rounding)."""
    with localcontext() as context:
        context.prec = 60  # far more digits than any token count times any price needs
        return Decimal(tokens) * price_per_million / MILLION


def money(amount: Decimal) -> str:
    """An amount for display: rounded half up to cents, e.g. "0.12"."""
    return str(amount.quantize(CENT, rounding=ROUND_HALF_UP))


@dataclass(frozen=True)
class StatementLine:
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int
    prompt_cost: Decimal
    completion_cost: Decimal

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def cost(self) -> Decimal:
        return self.prompt_cost + self.completion_cost


@dataclass(frozen=True)
class Statement:
    tenant: Tenant
    year: int
    month: int
    plan: str
    prompt_price_per_million: Decimal
    completion_price_per_million: Decimal
    period_start: datetime  # UTC, included
    period_end: datetime  # UTC, excluded
    lines: tuple[StatementLine, ...]

    @property
    def period(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"

    @property
    def requests(self) -> int:
        return sum(line.requests for line in self.lines)

    @property
    def prompt_tokens(self) -> int:
        return sum(line.prompt_tokens for line in self.lines)

    @property
    def completion_tokens(self) -> int:
        return sum(line.completion_tokens for line in self.lines)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def prompt_cost(self) -> Decimal:
        return sum((line.prompt_cost for line in self.lines), Decimal(0))

    @property
    def completion_cost(self) -> Decimal:
        return sum((line.completion_cost for line in self.lines), Decimal(0))

    @property
    def total_cost(self) -> Decimal:
        return self.prompt_cost + self.completion_cost


def statement_for(*, tenant: Tenant, year: int, month: int) -> Statement:
    """The tenant's statement for a UTC calendar month, from the ledger: every request billed
    for the tokens the worker counted, errors and disconnects included. Requests that used no
    token (refused before reaching a worker: unknown model, quota, bad input) cost nothing and
    stay off the statement; the usage page still shows them as errors."""
    start, end = month_bounds(year, month)  # InvalidInput for a month that does not exist
    plan = plan_for(tenant.plan)
    rows = (
        UsageRecord.objects.filter(tenant=tenant, created_at__gte=start, created_at__lt=end)
        .exclude(prompt_tokens=0, completion_tokens=0)
        .values("model")
        .annotate(requests=Count("id"), prompt=Sum("prompt_tokens"), completion=Sum("completion_tokens"))
        .order_by("model")
    )
    lines = tuple(
        StatementLine(
            model=row["model"],
            requests=row["requests"],
            prompt_tokens=row["prompt"] or 0,
            completion_tokens=row["completion"] or 0,
            prompt_cost=token_cost(row["prompt"] or 0, plan.prompt_price_per_million),
            completion_cost=token_cost(row["completion"] or 0, plan.completion_price_per_million),
        )
        for row in rows
    )
    return Statement(
        tenant=tenant,
        year=year,
        month=month,
        plan=tenant.plan,
        prompt_price_per_million=plan.prompt_price_per_million,
        completion_price_per_million=plan.completion_price_per_million,
        period_start=start,
        period_end=end,
        lines=lines,
    )


STATEMENT_CSV_HEADER = [
    "period",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "prompt_price_per_million",
    "completion_price_per_million",
    "prompt_cost",
    "completion_cost",
    "cost",
]


def statement_csv_rows(statement: Statement) -> Iterator[list]:
    """The header, one row per model, then a TOTAL row (header only for a month without use)."""
    yield STATEMENT_CSV_HEADER
    prices = [statement.prompt_price_per_million, statement.completion_price_per_million]
    for line in statement.lines:
        yield [
            statement.period,
            line.model,
            line.requests,
            line.prompt_tokens,
            line.completion_tokens,
            *prices,
            money(line.prompt_cost),
            money(line.completion_cost),
            money(line.cost),
        ]
    if statement.lines:
        yield [
            statement.period,
            "TOTAL",
            statement.requests,
            statement.prompt_tokens,
            statement.completion_tokens,
            *prices,
            money(statement.prompt_cost),
            money(statement.completion_cost),
            money(statement.total_cost),
        ]

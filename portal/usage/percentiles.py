"""Percentiles the way PostgreSQL's percentile_cont computes them, in SQL and in Python.

percentile_cont(p) over n sorted values interpolates linearly at position p·(n-1); the
Python twin gives the same numbers on databases without it (SQLite in `make run`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from django.db import connection
from django.db.models import Aggregate, FloatField

PERCENTILES = (0.50, 0.95, 0.99)


class PercentileCont(Aggregate):
    """PERCENTILE_CONT(p) WITHIN GROUP (ORDER BY expr), PostgreSQL only; NULLs are ignored."""

    function = "PERCENTILE_CONT"
    name = "PercentileCont"
    template = "%(function)s(%(fraction)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, fraction: float, **extra):
        fraction = float(fraction)
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {fraction}")
        # A float literal we formatted ourselves: nothing from outside reaches the SQL text.
        super().__init__(expression, fraction=repr(fraction), **extra)


def percentile_cont(values: Iterable[float | None], fraction: float) -> float | None:
    """percentile_cont in Python: None for no (non-None) values."""
    ordered = sorted(value for value in values if value is not None)
    if not ordered:
        return None
    position = fraction * (len(ordered) - 1)
    lower, upper = math.floor(position), math.ceil(position)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


def database_has_percentile_cont() -> bool:
    return connection.vendor == "postgresql"

"""UTC days and months as [start, end) datetime ranges over UsageRecord.created_at."""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

from portal.core.exceptions import InvalidInput


def day_bounds(day: date) -> tuple[datetime, datetime]:
    """[start, end) of a UTC day."""
    start = datetime.combine(day, time.min, tzinfo=UTC)
    return start, start + timedelta(days=1)


def days_bounds(start: date, end: date) -> tuple[datetime, datetime]:
    """[start of `start`, end of `end`) in UTC: both days included."""
    if end < start:
        raise InvalidInput("end", f"{end.isoformat()} is before start {start.isoformat()}")
    return day_bounds(start)[0], day_bounds(end)[1]


def month_bounds(year: int, month: int) -> tuple[datetime, datetime]:
    """[start, end) of a UTC calendar month."""
    if not 1 <= month <= 12:
        raise InvalidInput("month", f"must be 1-12, got {month}")
    if not 1 <= year <= 9998:
        raise InvalidInput("year", f"out of range: {year}")
    start = datetime(year, month, 1, tzinfo=UTC)
    end = datetime(year + 1, 1, 1, tzinfo=UTC) if month == 12 else datetime(year, month + 1, 1, tzinfo=UTC)
    return start, end


def utc_today(now: datetime) -> date:
    return now.astimezone(UTC).date()

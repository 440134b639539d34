"""The time range every dashboard takes, and the bucket its series are cut into.

    ?range=15m|1h|6h|24h|7d|30d          the last N minutes/hours/days, ending now
    ?range=custom&start=ISO&end=ISO      any span up to MAX_SPAN (ISO 8601, UTC if no offset)
    ?bucket=1m|5m|15m|1h|6h|1d           optional; by default the smallest that gives at most
                                         MAX_POINTS buckets over a live range, and the smallest
                                         roll-up granularity (1h, 1d: ROLLUP_BUCKETS) that gives
                                         at most MAX_ROLLUP_POINTS over a longer one

Buckets are aligned to multiples of their width since the Unix epoch (UTC), the way
PostgreSQL's date_bin(width, t, epoch) cuts them, so a bucket means the same minutes whichever
range asked for it. The first bucket may start before the range does; the series covers
[first bucket start, end).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.utils.dateparse import parse_datetime

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
RANGES: dict[str, timedelta] = {
    "15m": timedelta(minutes=15), "1h": timedelta(hours=1), "6h": timedelta(hours=6),
    "24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30),
}
BUCKETS: dict[str, timedelta] = {
    "1m": timedelta(minutes=1), "5m": timedelta(minutes=5), "15m": timedelta(minutes=15),
    "1h": timedelta(hours=1), "6h": timedelta(hours=6), "1d": timedelta(days=1),
}
DEFAULT_RANGE = "24h"
MAX_POINTS = 120  # a chart with more points than this is unreadable and slow to draw
# Beyond a live range, exact percentiles per bucket come from the usage roll-ups, which exist by
# the minute, hour and day only (portal.usage.rollups): a 15-minute bucket over 24 hours would
# be served by the hour anyway, so the default is what will be served.
ROLLUP_BUCKETS = ("1h", "1d")
MAX_ROLLUP_POINTS = 200
MAX_SPAN = timedelta(days=400)
# Ranges this short (or shorter) are watched as they happen: the pages poll their JSON.
LIVE_UP_TO = timedelta(hours=6)


class RangeError(ValueError):
    """A range parameter the dashboards cannot use; the message names the parameter."""


@dataclass(frozen=True)
class TimeRange:
    start: datetime  # inclusive, UTC
    end: datetime  # exclusive, UTC
    bucket: timedelta
    name: str  # one of RANGES, or "custom"

    @property
    def bucket_name(self) -> str:
        return next(name for name, width in BUCKETS.items() if width == self.bucket)

    @property
    def bucket_seconds(self) -> int:
        return int(self.bucket.total_seconds())

    @property
    def live(self) -> bool:
        """Whether the page should refresh itself: a range that ends now and is short."""
        return self.name != "custom" and self.end - self.start <= LIVE_UP_TO

    def floor(self, moment: datetime) -> datetime:
        """The start of the bucket `moment` falls in."""
        return moment - (moment - EPOCH) % self.bucket

    def buckets(self) -> list[datetime]:
        """Every bucket start from the one holding `start` up to `end` (exclusive)."""
        starts, moment = [], self.floor(self.start)
        while moment < self.end:
            starts.append(moment)
            moment += self.bucket
        return starts

    def as_json(self) -> dict:
        return {"range": self.name, "start": self.start.isoformat(), "end": self.end.isoformat(),
                "bucket": self.bucket_name, "bucket_seconds": self.bucket_seconds, "live": self.live}


def parse_range(params, *, now: datetime) -> TimeRange:
    """The TimeRange a request's GET parameters (any mapping) ask for; RangeError otherwise."""
    name = (params.get("range") or DEFAULT_RANGE).strip()
    if name == "custom":
        start, end = _moment(params, "start"), _moment(params, "end")
        if end <= start:
            raise RangeError(f"end: {end.isoformat()} is not after start {start.isoformat()}")
        if end - start > MAX_SPAN:
            raise RangeError(f"start/end: at most {MAX_SPAN.days} days apart")
    elif name in RANGES:
        end = now.astimezone(UTC)
        start = end - RANGES[name]
    else:
        raise RangeError(f"range: one of {', '.join([*RANGES, 'custom'])}, got {name[:20]!r}")
    raw_bucket = (params.get("bucket") or "").strip()
    if not raw_bucket:
        if end - start <= LIVE_UP_TO:
            bucket = next(width for width in BUCKETS.values() if (end - start) / width <= MAX_POINTS)
        else:
            bucket = next((BUCKETS[name] for name in ROLLUP_BUCKETS
                           if (end - start) / BUCKETS[name] <= MAX_ROLLUP_POINTS), BUCKETS["1d"])
    elif raw_bucket in BUCKETS:
        bucket = BUCKETS[raw_bucket]
        if (end - start) / bucket > 10 * MAX_POINTS:
            raise RangeError(f"bucket: {raw_bucket} cuts this range into more than {10 * MAX_POINTS} points")
    else:
        raise RangeError(f"bucket: one of {', '.join(BUCKETS)}, got {raw_bucket[:20]!r}")
    return TimeRange(start=start, end=end, bucket=bucket, name=name)


def _moment(params, key: str) -> datetime:
    raw = (params.get(key) or "").strip()
    if not raw:
        raise RangeError(f"{key}: required with range=custom (ISO 8601, e.g. 2026-12-01T09:30)")
    try:
        value = parse_datetime(raw)
    except ValueError:
        value = None
    if value is None:
        raise RangeError(f"{key}: not an ISO 8601 date and time: {raw[:40]!r}")
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC)

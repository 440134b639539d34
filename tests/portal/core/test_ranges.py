"""parse_range: the time range and bucket every dashboard takes from its query string."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest

from portal.core.ranges import MAX_POINTS, MAX_SPAN, RangeError, TimeRange, parse_range

NOW = datetime(2026, 12, 4, 18, 7, 30, 123456, tzinfo=UTC)


@pytest.mark.parametrize(("name", "span", "bucket", "live"), [
    ("15m", timedelta(minutes=15), timedelta(minutes=1), True),
    ("1h", timedelta(hours=1), timedelta(minutes=1), True),
    ("6h", timedelta(hours=6), timedelta(minutes=5), True),
    ("24h", timedelta(hours=24), timedelta(hours=1), False),
    ("7d", timedelta(days=7), timedelta(hours=1), False),
    ("30d", timedelta(days=30), timedelta(days=1), False),
])
def test_each_named_range_ends_now_with_its_default_bucket(name, span, bucket, live):
    time_range = parse_range({"range": name}, now=NOW)
    assert (time_range.name, time_range.start, time_range.end) == (name, NOW - span, NOW)
    assert time_range.bucket == bucket and time_range.live is live


def test_no_range_is_the_last_24_hours_and_a_non_utc_now_is_read_as_utc():
    time_range = parse_range({}, now=NOW.astimezone(timezone(timedelta(hours=-5))))
    assert time_range.name == "24h" and time_range.end == NOW and time_range.end.tzinfo == UTC
    assert parse_range({"range": " 1h ", "bucket": " "}, now=NOW).bucket == timedelta(minutes=1)


def test_an_explicit_bucket_wins_over_the_default():
    assert parse_range({"range": "24h", "bucket": "15m"}, now=NOW).bucket == timedelta(minutes=15)
    assert parse_range({"range": "7d", "bucket": "1d"}, now=NOW).bucket_name == "1d"


def test_custom_range_without_offset_is_utc_and_with_offset_is_converted():
    naive = parse_range({"range": "custom", "start": "2026-11-01T09:30", "end": "2026-11-01T10:30"}, now=NOW)
    assert naive.start == datetime(2026, 11, 1, 9, 30, tzinfo=UTC)
    assert naive.end == datetime(2026, 11, 1, 10, 30, tzinfo=UTC)
    assert naive.name == "custom" and naive.live is False  # a custom range is never refreshed
    assert naive.bucket == timedelta(minutes=1)
    shifted = parse_range({"range": "custom", "start": "2026-11-01T09:30+02:00", "end": "2026-11-03T00:00Z"},
                          now=NOW)
    assert shifted.start == datetime(2026, 11, 1, 7, 30, tzinfo=UTC) and shifted.start.tzinfo == UTC
    assert shifted.end == datetime(2026, 11, 3, tzinfo=UTC)
    assert shifted.bucket == timedelta(hours=1)  # 40.5 hours: past a live span, by the hour
    long = parse_range({"range": "custom", "start": "2026-01-01", "end": "2026-12-01"}, now=NOW)
    assert long.bucket == timedelta(days=1)  # 334 days: more than 200 hours, so by the day


def test_buckets_are_aligned_to_the_epoch_and_cover_the_range():
    time_range = parse_range({"range": "1h", "bucket": "5m"}, now=NOW)
    assert time_range.floor(NOW) == datetime(2026, 12, 4, 18, 5, tzinfo=UTC)
    starts = time_range.buckets()
    assert starts[0] == datetime(2026, 12, 4, 17, 5, tzinfo=UTC) <= time_range.start
    assert starts[-1] == datetime(2026, 12, 4, 18, 5, tzinfo=UTC) < time_range.end
    assert all(b - a == timedelta(minutes=5) for a, b in zip(starts, starts[1:], strict=False))
    assert len(starts) == 13  # the first bucket starts before the range does
    day = parse_range({"range": "30d"}, now=NOW)
    assert day.buckets()[0] == datetime(2026, 11, 4, tzinfo=UTC) and len(day.buckets()) == 31
    aligned = TimeRange(start=datetime(2026, 12, 4, tzinfo=UTC), end=datetime(2026, 12, 4, 6, tzinfo=UTC),
                        bucket=timedelta(hours=6), name="custom")
    assert aligned.buckets() == [datetime(2026, 12, 4, tzinfo=UTC)]
    assert aligned.as_json() == {"range": "custom", "start": "2026-12-04T00:00:00+00:00",
                                 "end": "2026-12-04T06:00:00+00:00", "bucket": "6h", "bucket_seconds": 21600,
                                 "live": False}


@pytest.mark.parametrize(("params", "parameter", "says"), [
    ({"range": "2w"}, "range:", "one of 15m, 1h, 6h, 24h, 7d, 30d, custom, got '2w'"),
    ({"range": "1h", "bucket": "2m"}, "bucket:", "one of 1m, 5m, 15m, 1h, 6h, 1d, got '2m'"),
    ({"range": "30d", "bucket": "1m"}, "bucket:", f"more than {10 * MAX_POINTS} points"),
    ({"range": "custom", "end": "2026-11-01T10:00"}, "start:", "required with range=custom"),
    ({"range": "custom", "start": "2026-11-01T10:00"}, "end:", "required with range=custom"),
    ({"range": "custom", "start": "yesterday", "end": "2026-11-01T10:00"}, "start:", "not an ISO 8601"),
    ({"range": "custom", "start": "2026-11-01T10:00", "end": "2026-13-01T10:00"}, "end:", "not an ISO 8601"),
    ({"range": "custom", "start": "2026-11-01T10:00", "end": "2026-11-01T10:00"}, "end:", "is not after start"),
    ({"range": "custom", "start": "2024-01-01", "end": "2026-01-01"}, "start/end:",
     f"at most {MAX_SPAN.days} days apart"),
])
def test_every_range_error_names_its_parameter(params, parameter, says):
    with pytest.raises(RangeError) as raised:
        parse_range(params, now=NOW)
    message = str(raised.value)
    assert message.startswith(parameter) and says in message


def test_a_long_bad_value_is_cut_in_the_message():
    with pytest.raises(RangeError) as raised:
        parse_range({"range": "x" * 500}, now=NOW)
    assert len(str(raised.value)) < 120

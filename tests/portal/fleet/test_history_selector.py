"""fleet_history: the poll history over a dashboard TimeRange, in its buckets, from the finest
resolution that still holds it; sums over healthy workers, rates from counter differences
(a worker restart never gives a negative rate), annotations from the state changes. Every test
runs on PostgreSQL's query and on the ORM path any other backend takes (make run's SQLite)."""

from datetime import UTC, datetime, timedelta

import pytest

from portal.core.ranges import TimeRange, parse_range
from portal.fleet.history import history_fold, history_resolution
from portal.fleet.models import InferenceWorker, WorkerEvent, WorkerSample
from portal.fleet.selectors import fleet_history

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("each_history_backend")]

NOON = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
MINUTE = timedelta(minutes=1)


def worker(name: str) -> InferenceWorker:
    return InferenceWorker.objects.create(url=f"http://{name}:8001", name=name)


def raw(w, at, *, healthy=True, **values):
    """A raw sample as the poll writes it; `values` are gauges (max = value) and counters."""
    if not healthy:
        return WorkerSample.objects.create(worker_id=w.pk, at=at, healthy=False, samples=0, state="unhealthy")
    counters = {k: values.pop(k) for k in list(values) if k in ("loads", "load_failures", "hits_host",
                                                               "evictions_device", "evictions_host")}
    return WorkerSample.objects.create(worker_id=w.pk, at=at, healthy=True, samples=1, state="healthy",
                                       **values, **{f"{k}_max": v for k, v in values.items()}, **counters)


def window(start, end, bucket=MINUTE) -> TimeRange:
    return TimeRange(start=start, end=end, bucket=bucket, name="custom")


def test_the_coarsest_resolution_that_holds_the_range_and_fits_its_buckets_is_read():
    now = NOON + timedelta(minutes=7, seconds=3)
    picks = {}
    for name, delta in (("15m", timedelta(minutes=15)), ("6h", timedelta(hours=6)), ("24h", timedelta(hours=24)),
                        ("7d", timedelta(days=7)), ("30d", timedelta(days=30))):
        time_range = parse_range({"range": name}, now=now)
        picks[name] = (time_range.bucket_name, history_resolution(time_range.floor(now - delta), time_range.bucket,
                                                                  now=now))
    assert picks == {"15m": ("1m", "minute"), "6h": ("5m", "minute"), "24h": ("1h", "hour"),
                     "7d": ("1h", "hour"), "30d": ("1d", "hour")}
    # Minute buckets 20 days ago: only hour rows are left. Buckets under a minute: raw polls.
    assert history_resolution(now - timedelta(days=20), MINUTE, now=now) == "hour"
    assert history_resolution(now - timedelta(hours=2), MINUTE, now=now) == "minute"
    assert history_resolution(now - timedelta(hours=2), timedelta(seconds=10), now=now) == "raw"
    assert history_resolution(now - timedelta(hours=25), timedelta(seconds=10), now=now) == "minute"


def test_buckets_are_aligned_and_a_bucket_without_a_healthy_sample_is_none():
    a, b = worker("gpu-a"), worker("gpu-b")
    raw(a, NOON + timedelta(minutes=4, seconds=50), num_running=2, num_waiting=1, kv_cache_usage=0.2,
        adapters_device=3, adapters_host=1, memory_kv_cache=100)
    raw(b, NOON + timedelta(minutes=4, seconds=55), num_running=5, num_waiting=0, kv_cache_usage=0.6,
        adapters_device=2, adapters_host=0, memory_kv_cache=300)
    raw(a, NOON + timedelta(minutes=5), num_running=4, num_waiting=3, kv_cache_usage=0.4, adapters_device=3,
        adapters_host=1, memory_kv_cache=100)
    raw(b, NOON + timedelta(minutes=5, seconds=10), healthy=False)  # b down: not in the sum
    raw(a, NOON + timedelta(minutes=10), healthy=False)

    history = fleet_history(time_range=window(NOON + timedelta(minutes=3, seconds=30), NOON + timedelta(minutes=15),
                                              bucket=timedelta(minutes=5)),
                            now=NOON + timedelta(minutes=15))

    assert history["resolution"] == "minute"  # nothing folded yet: every row is a raw poll
    assert history["buckets"] == [(NOON + timedelta(minutes=m)).isoformat() for m in (0, 5, 10)]
    series = history["series"]
    assert series["num_running"] == [7, 4, None]
    assert series["num_waiting"] == [1, 3, None]
    assert series["kv_cache_usage"] == [pytest.approx(0.4), pytest.approx(0.4), None]  # mean, not sum
    assert series["adapters"] == {"device": [5, 3, None], "host": [1, 1, None]}
    assert series["memory"]["kv_cache"] == [400, 100, None]
    assert series["memory"]["base_weights"] == [None, None, None]
    assert series["healthy"] == [2, 1, 0]
    assert history["workers"] == [{"id": a.pk, "name": "gpu-a"}, {"id": b.pk, "name": "gpu-b"}]


def test_a_worker_mean_and_peak_within_a_bucket():
    a = worker("gpu-a")
    for second, running in ((0, 1), (10, 5), (20, 3)):
        raw(a, NOON + timedelta(seconds=second), num_running=running, kv_cache_usage=running / 10)

    history = fleet_history(time_range=window(NOON, NOON + MINUTE), now=NOON + MINUTE)

    assert history["series"]["num_running"] == [pytest.approx(3.0)]
    assert history["series"]["peak"]["num_running"] == [5]
    assert history["series"]["peak"]["kv_cache_usage"] == [pytest.approx(0.5)]


def test_rates_come_from_counter_differences_and_a_restart_is_never_negative():
    a, b = worker("gpu-a"), worker("gpu-b")
    # gpu-a: loads 10 (before the range) -> 12 -> 15 | restart -> 1 -> 4; gpu-b: +6 in minute 0.
    raw(a, NOON - timedelta(seconds=10), loads=10, hits_host=0, evictions_device=0)
    raw(a, NOON + timedelta(seconds=20), loads=12, hits_host=4, evictions_device=1)
    raw(a, NOON + timedelta(seconds=40), loads=15, hits_host=4, evictions_device=2)
    raw(a, NOON + MINUTE + timedelta(seconds=10), loads=1, hits_host=0, evictions_device=0)
    raw(a, NOON + MINUTE + timedelta(seconds=30), loads=4, hits_host=2, evictions_device=0)
    raw(b, NOON + timedelta(seconds=5), loads=100)
    raw(b, NOON + timedelta(seconds=35), loads=106)

    history = fleet_history(time_range=window(NOON, NOON + 3 * MINUTE), now=NOON + 3 * MINUTE)

    series = history["series"]
    assert series["loads_per_min"]["host"] == [(2 + 3) + 6, 1 + 3, None]
    assert series["loads_per_min"]["device"] == [4, 0 + 2, None]
    assert series["evictions_per_min"]["device"] == [2, 0, None]
    assert all(v is None or v >= 0 for values in (series["loads_per_min"]["host"], series["loads_per_min"]["device"])
               for v in values)


def test_rates_are_per_minute_in_wider_buckets_and_in_the_bucket_in_progress():
    a = worker("gpu-a")
    raw(a, NOON, loads=0)
    raw(a, NOON + 4 * MINUTE, loads=10)  # 10 loads in the bucket 12:00-12:05
    raw(a, NOON + 6 * MINUTE, loads=16)  # 6 in the first two minutes of 12:05-12:10

    history = fleet_history(time_range=window(NOON, NOON + 7 * MINUTE, bucket=timedelta(minutes=5)),
                            now=NOON + 7 * MINUTE)

    assert history["series"]["loads_per_min"]["host"] == [pytest.approx(10 / 5), pytest.approx(6 / 2)]


def test_one_worker_only():
    a, b = worker("gpu-a"), worker("gpu-b")
    raw(a, NOON, num_running=2)
    raw(b, NOON, num_running=5)
    WorkerEvent.objects.create(worker_id=a.pk, worker_name="gpu-a", at=NOON, kind="healthy", detail="serves smollm2")
    WorkerEvent.objects.create(worker_id=b.pk, worker_name="gpu-b", at=NOON, kind="unhealthy", detail="timed out")

    history = fleet_history(time_range=window(NOON, NOON + MINUTE), worker=b.pk, now=NOON + MINUTE)

    assert history["series"]["num_running"] == [5]
    assert history["workers"] == [{"id": b.pk, "name": "gpu-b"}]
    assert history["annotations"] == [{"at": NOON.isoformat(), "worker": "gpu-b", "worker_id": b.pk,
                                       "kind": "unhealthy", "detail": "timed out"}]


def test_annotations_are_the_events_in_range_and_a_deleted_worker_keeps_its_name():
    gone = worker("pod-7")
    raw(gone, NOON, num_running=1)
    WorkerEvent.objects.create(worker_id=gone.pk, worker_name="pod-7", at=NOON - timedelta(hours=1), kind="healthy")
    WorkerEvent.objects.create(worker_id=gone.pk, worker_name="pod-7", at=NOON + 30 * timedelta(seconds=1),
                               kind="gone", detail="left the answer of dns://inference-headless:8001")
    InferenceWorker.objects.filter(pk=gone.pk).delete()

    history = fleet_history(time_range=window(NOON, NOON + 2 * MINUTE), now=NOON + 2 * MINUTE)

    assert [(a["worker"], a["kind"]) for a in history["annotations"]] == [("pod-7", "gone")]
    assert history["workers"] == [{"id": gone.pk, "name": "pod-7"}]
    assert history["series"]["num_running"] == [1, None]


def polls(workers, start, end):
    """A poll every 10 s on each worker: varying load, gpu-b down for 10 minutes, gpu-a restarted
    (its counters start again from 0) after 70 minutes."""
    at, n = start, 0
    while at < end:
        for i, w in enumerate(workers):
            if i == 1 and timedelta(minutes=40) <= at - start < timedelta(minutes=50):
                raw(w, at, healthy=False)
                continue
            restarted = i == 0 and at - start >= timedelta(minutes=70)
            count = n - 420 if restarted else n
            raw(w, at, num_running=(n * (i + 3)) % 11, num_waiting=n % 3, kv_cache_usage=(n % 10) / 10, adapters_device=n % 4,
                loads=count // 5 + i, hits_host=count // 2, evictions_device=count // 7)
        at += timedelta(seconds=10)
        n += 1


def test_folded_rows_read_the_same_as_the_raw_polls_they_fold():
    workers = [worker("gpu-a"), worker("gpu-b")]
    start = NOON - timedelta(hours=3)
    polls(workers, start - timedelta(minutes=10), start + timedelta(hours=2))
    now = start + timedelta(hours=2, minutes=5)
    ranges = [window(start, start + timedelta(hours=2), bucket=timedelta(minutes=15)),
              window(start, start + timedelta(hours=2), bucket=timedelta(hours=1))]
    before = [fleet_history(time_range=r, now=now) for r in ranges]
    assert WorkerSample.objects.exclude(resolution="raw").count() == 0

    history_fold(now=now)
    after = [fleet_history(time_range=r, now=now) for r in ranges]

    assert [h["resolution"] for h in after] == ["minute", "hour"]
    assert WorkerSample.objects.filter(resolution="hour").count() == 6  # 11:00 (partial), 12:00, 13:00 x 2
    for raw_read, folded_read in zip(before, after, strict=True):
        assert folded_read["buckets"] == raw_read["buckets"]
        for name in ("num_running", "kv_cache_usage", "healthy"):
            assert folded_read["series"][name] == pytest.approx(raw_read["series"][name]), name
        for name in ("peak", "adapters", "loads_per_min", "evictions_per_min"):
            for key, values in raw_read["series"][name].items():
                assert folded_read["series"][name][key] == pytest.approx(values), (name, key)
    assert None not in after[0]["series"]["num_running"]
    assert min(after[0]["series"]["loads_per_min"]["host"]) >= 0


def test_raw_polls_fill_what_is_not_folded_yet():
    a = worker("gpu-a")
    start = NOON - timedelta(hours=1)
    polls([a], start, NOON)
    time_range = window(start, NOON, bucket=timedelta(minutes=15))
    unfolded = fleet_history(time_range=time_range, now=NOON)

    history_fold(now=start + 50 * MINUTE)  # folds up to 11:49 only: the rest stays raw
    partly = fleet_history(time_range=time_range, now=NOON)

    assert partly["series"]["num_running"] == pytest.approx(unfolded["series"]["num_running"])
    # The first bucket aside: no poll before the range, so the first folded minute has no
    # predecessor and the increments inside it are not seen (the first raw poll's are).
    for key, values in unfolded["series"]["loads_per_min"].items():
        assert partly["series"]["loads_per_min"][key][1:] == pytest.approx(values[1:])


def test_an_empty_history_is_all_none():
    history = fleet_history(time_range=window(NOON, NOON + 2 * MINUTE), now=NOON + 2 * MINUTE)

    assert history["series"]["num_running"] == [None, None]
    assert history["series"]["loads_per_min"] == {"host": [None, None], "device": [None, None]}
    assert (history["workers"], history["annotations"]) == ([], [])

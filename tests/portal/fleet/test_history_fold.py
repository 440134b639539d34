"""Downsampling and retention of the poll history (portal.fleet.history.history_fold): means,
maxes and last values of known samples, exactly; only complete buckets; reruns change nothing;
retention deletes only what is old and already folded. Every test runs on both folds: PostgreSQL's
INSERT ... SELECT, and the ORM fold any other backend takes (make run's embedded SQLite)."""

from datetime import UTC, datetime, timedelta

import pytest

from portal.fleet.history import history_fold, history_prune
from portal.fleet.models import InferenceWorker, WorkerEvent, WorkerSample

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("each_history_backend")]

NOON = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


@pytest.fixture
def worker() -> InferenceWorker:
    return InferenceWorker.objects.create(url="http://gpu-0:8001", name="gpu-0")


def raw(worker, at, *, healthy=True, running=0, kv=0.0, loads=None, hits_host=None, memory=None, **fields):
    """A raw sample as the poll writes it (gauge and max alike; nothing known when unhealthy)."""
    if not healthy:
        return WorkerSample.objects.create(worker_id=worker.pk, at=at, healthy=False, samples=0, state="unhealthy")
    values = {"num_running": running, "kv_cache_usage": kv, "memory_kv_cache": memory}
    return WorkerSample.objects.create(
        worker_id=worker.pk, at=at, healthy=True, samples=1, state="healthy", loads=loads, hits_host=hits_host,
        **values, **{f"{k}_max": v for k, v in values.items()}, **fields)


def rows(resolution):
    return list(WorkerSample.objects.filter(resolution=resolution).order_by("worker_id", "at"))


def test_a_minute_folds_to_the_mean_and_max_over_healthy_polls_and_the_last_counter(worker):
    other = InferenceWorker.objects.create(url="http://gpu-1:8001")
    for second, running, kv, loads in ((0, 2, 0.1, 10), (10, 4, 0.3, 11), (20, 9, 0.2, 11), (50, 1, 0.6, 14)):
        raw(worker, NOON + timedelta(seconds=second), running=running, kv=kv, loads=loads, memory=1000 + second)
    raw(worker, NOON + timedelta(seconds=30), healthy=False)
    raw(worker, NOON + timedelta(seconds=40), loads=None, running=4)  # a worker that lost its counter
    raw(other, NOON + timedelta(seconds=5), running=7, loads=3)
    raw(worker, NOON + timedelta(minutes=1, seconds=5), running=100)  # the next minute: not complete yet

    done = history_fold(now=NOON + timedelta(minutes=2))  # 12:01 ended 0 s ago: inside FOLD_GRACE

    assert done["minute"] == 2
    mine, theirs = rows("minute")
    assert (mine.at, mine.polls, mine.samples, mine.healthy, mine.state) == (NOON, 6, 5, True, "healthy")
    assert mine.num_running == pytest.approx((2 + 4 + 9 + 1 + 4) / 5)
    assert mine.num_running_max == 9
    assert mine.kv_cache_usage == pytest.approx((0.1 + 0.3 + 0.2 + 0.6 + 0.0) / 5) and mine.kv_cache_usage_max == 0.6
    assert mine.memory_kv_cache == pytest.approx((1000 + 1010 + 1020 + 1050) / 4)  # the mean of the known ones
    assert mine.loads == 14  # the last known value, not the last row's NULL
    assert (theirs.worker_id, theirs.num_running, theirs.loads, theirs.polls) == (other.pk, 7, 3, 1)

    history_fold(now=NOON + timedelta(minutes=2, seconds=31))
    assert [(r.at, r.num_running) for r in rows("minute")] == [
        (NOON, mine.num_running), (NOON + timedelta(minutes=1), 100), (NOON, 7)]


def test_a_minute_with_no_healthy_poll_says_so_with_nothing_known(worker):
    raw(worker, NOON, healthy=False)
    WorkerSample.objects.filter(worker_id=worker.pk).update(state="draining")

    history_fold(now=NOON + timedelta(minutes=5))

    (row,) = rows("minute")
    assert (row.polls, row.samples, row.healthy, row.state) == (1, 0, False, "draining")
    assert (row.num_running, row.num_running_max, row.loads) == (None, None, None)


def test_an_hour_is_the_mean_of_its_polls_not_of_its_minutes(worker):
    # Minute 12:00: six polls at 1; minute 12:30: one poll at 10 and five unhealthy ones.
    for second in range(0, 60, 10):
        raw(worker, NOON + timedelta(seconds=second), running=1, loads=5)
    raw(worker, NOON + timedelta(minutes=30), running=10, loads=8)
    for second in range(10, 60, 10):
        raw(worker, NOON + timedelta(minutes=30, seconds=second), healthy=False)

    done = history_fold(now=NOON + timedelta(hours=1, minutes=1))

    assert done["minute"] == 2 and done["hour"] == 1
    (hour,) = rows("hour")
    assert (hour.at, hour.polls, hour.samples) == (NOON, 12, 7)
    assert hour.num_running == pytest.approx((6 * 1 + 10) / 7)  # not (1 + 10) / 2
    assert (hour.num_running_max, hour.loads, hour.state) == (10, 8, "unhealthy")


def test_a_rerun_changes_nothing_and_a_missed_run_is_made_up(worker):
    for minute in range(5):
        raw(worker, NOON + timedelta(minutes=minute), running=minute)
    history_fold(now=NOON + timedelta(minutes=2, seconds=30))
    assert [r.num_running for r in rows("minute")] == [0, 1]

    # The task did not run for a while: the next run folds every complete minute since.
    history_fold(now=NOON + timedelta(minutes=9))
    history_fold(now=NOON + timedelta(minutes=9))

    assert [(r.at.minute, r.num_running) for r in rows("minute")] == [(m, m) for m in range(5)]


def test_retention_deletes_only_what_is_old_and_folded(worker):
    now = NOON
    raw(worker, now - timedelta(hours=25), running=1)  # old, and folded by this run: goes
    raw(worker, now - timedelta(hours=23), running=2)  # within RAW_KEEP: stays
    WorkerSample.objects.create(worker_id=worker.pk, at=now - timedelta(days=15, hours=1), resolution="minute",
                                healthy=True, state="healthy", num_running=3)  # old, folded below: goes
    WorkerSample.objects.create(worker_id=worker.pk, at=now - timedelta(days=13), resolution="minute",
                                healthy=True, state="healthy", num_running=4)
    WorkerSample.objects.create(worker_id=worker.pk, at=now - timedelta(days=401), resolution="hour",
                                healthy=True, state="healthy", num_running=5)  # past HOUR_KEEP: goes
    WorkerSample.objects.create(worker_id=worker.pk, at=now - timedelta(days=399), resolution="hour",
                                healthy=True, state="healthy", num_running=6)
    WorkerEvent.objects.create(worker_id=worker.pk, worker_name="gpu-0", at=now - timedelta(days=401), kind="healthy")
    WorkerEvent.objects.create(worker_id=worker.pk, worker_name="gpu-0", at=now - timedelta(days=399), kind="gone")

    done = history_fold(now=now)

    assert (done["raw_deleted"], done["minute_deleted"], done["hour_deleted"], done["events_deleted"]) == (1, 1, 1, 1)
    assert [r.num_running for r in rows("raw")] == [2]
    # The raw row that went was folded first: its minute is there.
    assert 1 in [r.num_running for r in rows("minute")] and 4 in [r.num_running for r in rows("minute")]
    assert 3 not in [r.num_running for r in rows("minute")]
    assert [r.num_running for r in rows("hour") if r.at < now - timedelta(days=398)] == [6]
    assert list(WorkerEvent.objects.values_list("kind", flat=True)) == ["gone"]


def test_raw_rows_not_folded_yet_are_kept_however_old(worker):
    raw(worker, NOON - timedelta(days=3), running=1)

    assert history_prune(now=NOON)["raw_deleted"] == 0
    assert len(rows("raw")) == 1


def test_the_fold_task_is_on_the_beat_schedule():
    from portal.celery import app

    entry = app.conf.beat_schedule["fleet-history-fold"]
    assert (entry["task"], entry["schedule"]) == ("portal.fleet.tasks.fleet_history_fold_task", 60.0)
    assert "portal.fleet.tasks.fleet_history_fold_task" in app.tasks


def test_the_fold_task_folds(worker):
    from portal.fleet.tasks import fleet_history_fold_task

    raw(worker, datetime.now(UTC) - timedelta(minutes=5), running=3)

    done = fleet_history_fold_task.apply().get()

    assert done["minute"] == 1 and rows("minute")[0].num_running == 3

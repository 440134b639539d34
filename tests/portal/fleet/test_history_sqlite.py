"""The poll history on the embedded SQLite database `make run` uses without DATABASE_URL: the
fold (portal.fleet.history) and the dashboards' reading of it (portal.fleet.selectors), on a
real SQLite file. test_history_fold and test_history_selector run every test on that path too."""

from tests.portal.embedded_sqlite import run_on_embedded_sqlite


def test_the_history_folds_and_reads_on_the_embedded_sqlite_database(tmp_path):
    """make run without DATABASE_URL: the beat task folds (a rerun writes nothing new) and the
    fleet dashboard reads the folded minutes."""
    code = (
        "from datetime import UTC, datetime, timedelta\n"
        "from django.core.management import call_command\n"
        "call_command('migrate', verbosity=0)\n"
        "from portal.fleet.history import history_fold\n"
        "from portal.fleet.models import InferenceWorker, WorkerSample\n"
        "noon = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)\n"
        "w = InferenceWorker.objects.create(url='http://127.0.0.1:8001')\n"
        "for i, running in enumerate([2, 4, 9, 1, 6, 6, 3]):\n"
        "    WorkerSample.objects.create(worker_id=w.pk, at=noon + timedelta(seconds=20 * i), healthy=True,\n"
        "        samples=1, state='healthy', num_running=running, num_running_max=running, loads=i)\n"
        "print(history_fold(now=noon + timedelta(hours=1, minutes=1)))\n"
        "print(history_fold(now=noon + timedelta(hours=1, minutes=1)))\n"
        "from portal.core.ranges import TimeRange\n"
        "from portal.fleet.selectors import fleet_history\n"
        "span = TimeRange(start=noon, end=noon + timedelta(minutes=3), bucket=timedelta(minutes=1), name='custom')\n"
        "history = fleet_history(time_range=span, now=noon + timedelta(hours=1, minutes=1))\n"
        "print(history['resolution'], history['series']['num_running'], history['series']['loads_per_min'])\n"
        "for r in WorkerSample.objects.exclude(resolution='raw').order_by('resolution', 'at'):\n"
        "    print(r.resolution, r.at.minute, r.polls, round(r.num_running, 3), r.num_running_max, r.loads)\n")
    result = run_on_embedded_sqlite(code, tmp_path / "db.sqlite3")

    assert result.returncode == 0, result.stderr
    first, rerun, read, *folded = result.stdout.strip().splitlines()
    assert "'minute': 3" in first and "'hour': 1" in first and "'hour': 0" in rerun
    # per minute: the mean of its polls; loads per minute from the differences of each minute's
    # last count (2, 5, 6): the first minute has nothing before it
    assert read == "minute [5.0, 4.333333333333333, 3.0] {'host': [None, 3.0, 1.0], 'device': [None, None, None]}"
    assert folded == ["hour 0 7 4.429 9.0 6",
                      "minute 0 3 5.0 9.0 2", "minute 1 3 4.333 6.0 5", "minute 2 1 3.0 3.0 6"]

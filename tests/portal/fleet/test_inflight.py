"""The gateway's own in-flight ledger: counts now, and how they changed since a moment (what
routing adds to a poll's load). A hand-driven clock: nothing here sleeps."""

from portal.fleet.inflight import InflightLedger, InflightSnapshot

A, B = "http://a:8001", "http://b:8001"


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_counts_per_worker_go_up_and_down():
    ledger = InflightLedger(clock=Clock())
    for url in (A, A, B):
        ledger.started(url)
    ledger.finished(A)

    snap = ledger.snapshot()

    assert isinstance(snap, InflightSnapshot)
    assert dict(snap) == {A: 1, B: 1}
    assert snap.get("http://never:8001", 0) == 0


def test_a_snapshot_keeps_its_moment_while_requests_go_on():
    clock = Clock()
    ledger = InflightLedger(clock=clock)
    ledger.started(A)
    before = ledger.snapshot()

    clock.now += 1
    ledger.started(A)
    ledger.started(A)

    assert before[A] == 1 and before.change_since(A, 999.0) == 1
    assert ledger.snapshot()[A] == 3


def test_change_since_counts_what_started_and_finished_after_the_moment():
    clock = Clock(100.0)
    ledger = InflightLedger(clock=clock)
    ledger.started(A)  # t=100: in flight at the poll below
    ledger.started(A)
    clock.now = 105.0  # the poll reads the worker here
    ledger.started(A)  # an event at the poll's own moment counts as after it
    clock.now = 107.0
    ledger.finished(A)
    ledger.finished(A)
    ledger.started(A)

    snap = ledger.snapshot()

    assert snap[A] == 2
    assert snap.change_since(A, 105.0) == 0  # +1 -2 +1
    assert snap.change_since(A, 106.0) == -1  # -2 +1
    assert snap.change_since(A, 99.0) == 2  # everything
    assert snap.change_since(A, 200.0) == 0  # a moment still to come: nothing after it
    assert snap.change_since(B, 99.0) == 0  # never sent anything there


def test_a_moment_older_than_the_memory_is_unknown():
    clock = Clock(0.0)
    ledger = InflightLedger(clock=clock, keep_seconds=10.0)
    ledger.started(A)
    clock.now = 5.0
    ledger.started(A)
    clock.now = 30.0  # more than twice keep_seconds after the first event: the history is pruned
    ledger.finished(A)

    snap = ledger.snapshot()

    assert snap[A] == 1
    assert snap.change_since(A, 1.0) is None  # before what it kept
    assert snap.change_since(A, 6.0) == -1  # since the last event it dropped: still known
    assert snap.change_since(A, 31.0) == 0


def test_the_count_never_goes_below_zero_and_time_never_runs_backwards():
    clock = Clock(50.0)
    ledger = InflightLedger(clock=clock)
    ledger.finished(A)  # a finish without a start (a ledger closed twice would be a bug elsewhere)
    assert ledger.snapshot()[A] == 0

    ledger.started(A)
    clock.now = 40.0  # the wall clock stepped back (NTP)
    ledger.started(A)
    snap = ledger.snapshot()
    assert snap[A] == 2
    assert snap.change_since(A, 45.0) == 2  # both count after 45: the second kept the first's time

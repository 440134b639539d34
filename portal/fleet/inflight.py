"""This process's requests in flight on each worker, and how that count changed since a moment.

The fleet poll reads each worker's running + waiting counts every 10 s; between polls that load
is stale. Routing (portal.fleet.selectors.worker_load) estimates a worker's load now as its polled
load plus the change in this process's own count since that poll: exact with one web process,
and with several it misses only the other processes' changes, which their own estimates carry.

(The larger of the polled load and the own count, the estimate before this, kept a worker whose
requests had finished looking as loaded as at the poll until the next one: under the relative
bound every request then went to the other workers, and the fleet swung between two halves
from poll to poll. bench/fleet_sim.py, one web process: imbalance 1.32 steady, 1.58 with churn.)

A count starts when a worker accepts a completion and ends when its ledger closes.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

# How far back a snapshot can say what changed: a few poll intervals (the beat polls every 10 s).
# A row polled longer ago than this falls back to the larger of its polled load and the own count.
KEEP_SECONDS = 60.0


@dataclass(frozen=True)
class History:
    """One worker's own count over time. Append-only (pruning starts a new one), so a snapshot
    holding it and a length reads a fixed past while the requests go on."""

    since: float  # the count is known from here on (-inf: since this process started)
    base: int  # the count at `since`, before times[0]
    times: list[float]  # event times, increasing
    counts: list[int]  # the count just after each event

    def count_at(self, moment: float, length: int) -> int | None:
        """The count at `moment` (epoch seconds), before any event at that very moment, over the
        first `length` events; None before `since`."""
        if moment < self.since:
            return None
        i = bisect.bisect_left(self.times, moment, 0, length)
        return self.counts[i - 1] if i else self.base


class InflightSnapshot(Mapping[str, int]):
    """{worker url: this process's requests in flight there} at one moment, which can also say
    how much that count changed since an earlier moment (change_since)."""

    def __init__(self, histories: Mapping[str, tuple[History, int]]) -> None:
        self._histories = dict(histories)  # url -> (history, events it had)

    def __getitem__(self, url: str) -> int:
        history, length = self._histories[url]
        return history.counts[length - 1] if length else history.base

    def __iter__(self) -> Iterator[str]:
        return iter(self._histories)

    def __len__(self) -> int:
        return len(self._histories)

    def change_since(self, url: str, moment: float) -> int | None:
        """Requests started minus requests finished on `url` after `moment` (epoch seconds); None
        when that is further back than this process remembers."""
        if url not in self._histories:
            return 0  # never sent anything there
        history, length = self._histories[url]
        then = history.count_at(moment, length)
        return None if then is None else self[url] - then


class InflightLedger:
    def __init__(self, *, clock: Callable[[], float] = time.time, keep_seconds: float = KEEP_SECONDS) -> None:
        self._clock = clock  # wall clock: compared with the rows' last_polled_at, written by another process
        self._keep = keep_seconds
        self._lock = threading.Lock()  # the gateway's event loop and the ledger's detached tasks both touch it
        self._histories: dict[str, History] = {}

    def started(self, url: str) -> None:
        self._record(url, +1)

    def finished(self, url: str) -> None:
        self._record(url, -1)

    def snapshot(self) -> InflightSnapshot:
        with self._lock:
            return InflightSnapshot({url: (h, len(h.times)) for url, h in self._histories.items()})

    def _record(self, url: str, step: int) -> None:
        with self._lock:
            now = self._clock()
            history = self._histories.get(url)
            if history is None:
                history = self._histories[url] = History(since=-math.inf, base=0, times=[], counts=[])
            count = max((history.counts[-1] if history.counts else history.base) + step, 0)
            history.times.append(max(now, history.times[-1]) if history.times else now)  # never backwards
            history.counts.append(count)
            if history.times[0] < now - 2 * self._keep:  # prune about once per keep_seconds
                self._histories[url] = _pruned(history, now - self._keep)


def _pruned(history: History, cut: float) -> History:
    """The same history without the events before `cut`: it starts at the last one dropped."""
    i = bisect.bisect_left(history.times, cut)
    if i == 0:
        return history
    return History(since=history.times[i - 1], base=history.counts[i - 1],
                   times=history.times[i:], counts=history.counts[i:])


_ledger = InflightLedger()


def inflight_started(url: str) -> None:
    _ledger.started(url)


def inflight_finished(url: str) -> None:
    _ledger.finished(url)


def inflight_snapshot() -> InflightSnapshot:
    """{worker url: requests this process has in flight there}, with change_since."""
    return _ledger.snapshot()

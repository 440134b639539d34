"""This process's requests in flight on each worker, for routing between fleet polls.

The fleet poll reads each worker's running + waiting counts every 10 s; between polls that load
is stale, and every request for a hot adapter went to the same least-loaded-10-s-ago worker
(bench/fleet_sim.py: imbalance up to 2.2 where live loads give 1.1-1.24). The gateway counts what
it has sent itself; routing takes the larger of that count and the polled load (the poll already
includes this process's older requests, so the larger of the two is never a double count).

A count starts when a worker accepts a completion and ends when its ledger closes; several web
processes each count their own share.
"""

from __future__ import annotations

import threading
from collections import Counter

_counts: Counter[str] = Counter()
_lock = threading.Lock()  # the gateway's event loop and the ledger's detached tasks both touch it


def inflight_started(url: str) -> None:
    with _lock:
        _counts[url] += 1


def inflight_finished(url: str) -> None:
    with _lock:
        _counts[url] -= 1
        if _counts[url] <= 0:
            del _counts[url]


def inflight_snapshot() -> dict[str, int]:
    """{worker url: requests this process has in flight there}."""
    with _lock:
        return dict(_counts)

"""The web process's Prometheus metrics, defined once: GET /metrics (portal.core.metrics_asgi)
serves REGISTRY. The names are what the Grafana dashboard reads; rename nothing lightly.

Counted where each fact happens (one place per fact):

    loraplex_gateway_requests_total{tenant,model,status}         portal.gateway.observe, when a
    loraplex_gateway_request_duration_seconds{tenant,model}        /v1 request ends (streams: at
    loraplex_gateway_time_to_first_token_seconds{tenant,model}     their last byte)
    loraplex_gateway_errors_total{tenant,model,code}
    loraplex_gateway_quota_rejections_total{tenant,limit}          portal.gateway.admit
    loraplex_gateway_upstream_retries_total{worker,reason}         portal.gateway.relay
    loraplex_ledger_writes_total{outcome}                          portal.usage.spool

Read at scrape time:

    loraplex_celery_queue_depth{queue}      LLEN of each Celery queue on the Redis broker
    loraplex_fleet_workers{state}           InferenceWorker rows (portal.fleet.metrics, registered
                                            by FleetConfig.ready: core imports no app)

Labels never carry what a caller typed: tenant is an authenticated tenant's slug ("" before
authentication), model a public id the gateway resolved ("unknown" when it did not, "" when the
request names none), code and reason come from the gateway's and the workers' own vocabularies.

Every web replica reports the same scrape-time gauges and the same replayed/dead totals (they
describe shared state, not the replica): aggregate those with max(), the counters with sum().

The web runs as one uvicorn process per container (deploy/Dockerfile.web's CMD, one worker), so
the counters live in that process's memory: no prometheus_client multiprocess mode is needed.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator, Mapping

import redis
from django.conf import settings
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# `*_created` series would double every counter's series for a timestamp nobody graphs.
disable_created_metrics()

REGISTRY = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_* series
    REGISTRY.register(_collector)

# Whole requests: a stream lasts as long as its tokens take.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
UNKNOWN = "unknown"  # the model label of a request whose model was not resolved
OTHER = "other"  # a code or reason outside LABEL_PATTERN
LABEL_PATTERN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
REDIS_TIMEOUT = 2.0

GATEWAY_REQUESTS = Counter(
    "loraplex_gateway_requests", "/v1 requests answered, by tenant, model and HTTP status (499: the client left "
    "before any answer).", ["tenant", "model", "status"], registry=REGISTRY)
GATEWAY_REQUEST_DURATION = Histogram(
    "loraplex_gateway_request_duration_seconds", "/v1 requests from arrival to the last byte (streams included).",
    ["tenant", "model"], buckets=DURATION_BUCKETS, registry=REGISTRY)
GATEWAY_TIME_TO_FIRST_TOKEN = Histogram(
    "loraplex_gateway_time_to_first_token_seconds", "Successful completions from arrival to the first body byte: "
    "the first streamed chunk, or the whole answer when not streaming.", ["tenant", "model"],
    buckets=TTFT_BUCKETS, registry=REGISTRY)
GATEWAY_ERRORS = Counter(
    "loraplex_gateway_errors", "OpenAI-shaped errors sent to clients, by their code (their type when the code is "
    "null); an error inside a 200 stream counts too.", ["tenant", "model", "code"], registry=REGISTRY)
QUOTA_REJECTIONS = Counter(
    "loraplex_gateway_quota_rejections", "Requests refused by a quota (429), by the limit that refused them.",
    ["tenant", "limit"], registry=REGISTRY)
UPSTREAM_RETRIES = Counter(
    "loraplex_gateway_upstream_retries", "Times the gateway gave up on a worker before the first byte and tried "
    "the next one, by the worker given up on and why.", ["worker", "reason"], registry=REGISTRY)


def label(value: object) -> str:
    """A code or reason as a label value: itself when it looks like one, else OTHER."""
    text = str(value or "")
    return text if LABEL_PATTERN.fullmatch(text) else OTHER


class LedgerWrites(Collector):
    """loraplex_ledger_writes_total{outcome}. written / spooled: this process's ledger rows, as
    portal.usage.spool saved them (count). replayed / dead: spooled rows written back or set aside
    by the spool replay, which runs in a Celery worker; it keeps its totals in Redis and
    `replay_totals` (set by portal.usage's AppConfig) reads them at scrape time (absent when
    there is no Redis or it does not answer)."""

    LOCAL = ("written", "spooled")
    SHARED = ("replayed", "dead")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.LOCAL, 0)
        self.replay_totals: Callable[[], Mapping[str, int] | None] | None = None

    def count(self, outcome: str) -> None:
        if outcome not in self.LOCAL:
            raise ValueError(f"not an outcome this process counts: {outcome!r}")
        with self._lock:
            self._counts[outcome] += 1

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily("loraplex_ledger_writes", "Ledger (usage) rows: written by the gateway, "
                                     "spooled when the database refused, replayed from the spool, dead (set aside).",
                                     labels=["outcome"])
        with self._lock:
            counts = dict(self._counts)
        for outcome in self.LOCAL:
            family.add_metric([outcome], counts[outcome])
        shared = None
        if self.replay_totals is not None:
            try:
                shared = self.replay_totals()
            except Exception:  # noqa: BLE001 -- a scrape never fails for one source
                log.warning("metrics: the spool replay totals could not be read", exc_info=True)
        for outcome in self.SHARED if shared is not None else ():
            family.add_metric([outcome], int(shared.get(outcome, 0)))
        yield family


class CeleryQueueDepth(Collector):
    """loraplex_celery_queue_depth{queue}: messages waiting in each queue of
    settings.CELERY_TASK_QUEUES on the broker, REDIS_URL (kombu keeps a queue as a list of its
    name). Nothing without Redis (tasks run in-process) or when it does not answer."""

    def collect(self) -> Iterator[Metric]:
        url = settings.REDIS_URL
        if not url:
            return
        names = [queue.name for queue in settings.CELERY_TASK_QUEUES]
        client = redis.Redis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT, socket_timeout=REDIS_TIMEOUT)
        try:
            pipeline = client.pipeline(transaction=False)
            for name in names:
                pipeline.llen(name)
            depths = pipeline.execute()
        except redis.RedisError as exc:
            log.warning("metrics: Celery queue depth unavailable (%s)", exc)
            return
        finally:
            client.close()
        family = GaugeMetricFamily("loraplex_celery_queue_depth", "Celery messages waiting on the broker, by queue.",
                                   labels=["queue"])
        for name, depth in zip(names, depths, strict=True):
            family.add_metric([name], depth)
        yield family


LEDGER_WRITES = LedgerWrites()
REGISTRY.register(LEDGER_WRITES)
REGISTRY.register(CeleryQueueDepth())

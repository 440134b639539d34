"""loraplex_fleet_workers{state}: the inference workers by state, read from their rows when
/metrics is scraped (portal.core.metrics; FleetConfig.ready registers it there)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from portal.fleet.models import WORKER_STATES
from portal.fleet.selectors import worker_state_counts

log = logging.getLogger(__name__)


class FleetWorkers(Collector):
    def collect(self) -> Iterator[Metric]:
        try:
            counts = worker_state_counts()
        except Exception:  # noqa: BLE001 -- the database down: this family is absent, the scrape goes on
            log.warning("metrics: the fleet's workers could not be counted", exc_info=True)
            return
        family = GaugeMetricFamily("loraplex_fleet_workers", "Inference workers by state: healthy or unhealthy at "
                                   "the last poll, mismatched (another base model), gone (left its DNS name) "
                                   "or disabled in the admin.", labels=["state"])
        for state in WORKER_STATES:
            family.add_metric([state], counts[state])
        yield family

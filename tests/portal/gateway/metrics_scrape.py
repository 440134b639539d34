"""Test helper: the gateway's /metrics as Prometheus reads it. Import as
`tests.portal.gateway.metrics_scrape`.

    before = scrape(live.url)        # development: open; production: scrape(url, authorization=...)
    ...
    after = scrape(live.url)
    after("loraplex_gateway_requests_total", tenant="acme", model="smollm2", status="200")
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One /metrics answer: sample values by name and labels."""

    def __init__(self, response: httpx.Response):
        assert response.status_code == 200, response.text
        self.text = response.text
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for family in text_string_to_metric_families(self.text) for s in family.samples}

    def __call__(self, name: str, **labels: str) -> float:
        """The sample's value; 0 when there is none (a series not yet incremented)."""
        return self.samples.get((name, frozenset(labels.items())), 0.0)

    def series(self, name: str, **labels: str) -> list[frozenset]:
        """The label sets of every sample of `name` carrying these labels."""
        return [key for sample, key in self.samples if sample == name and frozenset(labels.items()) <= key]

    def has(self, name: str, **labels: str) -> bool:
        return (name, frozenset(labels.items())) in self.samples


def scrape(url: str, **headers: str) -> Scrape:
    return Scrape(httpx.get(f"{url}/metrics", headers=headers, timeout=30))

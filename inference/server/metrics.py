"""GET /metrics: Prometheus text, vLLM's metric names where vLLM has one.

Latency histograms and the finish-reason counter are observed as outputs reach the event loop.
Everything else (queue lengths, KV usage, token totals, adapter residency, cache hits, memory) is
read at scrape time by a collector from the engine thread's snapshot and the engine's thread-safe
adapter stats, so nothing is pushed on the hot path. Each app has its own CollectorRegistry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from inference.server.async_engine import AsyncEngine, RequestStream, StepOutput

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TIERS = ("device", "host", "loading", "disk", "failed")


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: callable) -> None:
        """model_name(): the served base name (known once the model is loaded)."""
        self.engine = engine
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", ["model_name"],
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.", ["model_name"],
                             buckets=E2E_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finish_reason"], registry=self.registry)
        self.adapter_requests = Counter("loraplex:adapter_requests", "Finished requests per adapter ('' = base).",
                                        ["adapter"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def on_output(self, item: StepOutput, stream: RequestStream) -> None:
        """Called on the event loop for every engine output before its stream sees it."""
        out = item.output
        model = self._model_name()
        if out.delta_token_ids:
            previous = stream.last_output_time.get(out.request_id)
            if previous is None:
                if out.time_to_first_token is not None:
                    self.ttft.labels(model).observe(out.time_to_first_token)
                # The rest of the first output's tokens (a multi-token step) have no gap to report.
            else:
                gap = (item.time - previous) / len(out.delta_token_ids)
                for _ in out.delta_token_ids:
                    self.itl.labels(model).observe(gap)
        if out.finished:
            if out.latency is not None:
                self.e2e.labels(model).observe(out.latency)
            self.success.labels(model, out.finish_reason or "unknown").inc()
            self.adapter_requests.labels(stream.adapter_name or "").inc()


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self):
        engine = self.m.engine
        model = self.m._model_name()
        snap = engine.snapshot

        def gauge(name: str, doc: str, value: float, labels: dict | None = None) -> GaugeMetricFamily:
            labels = {"model_name": model, **(labels or {})}
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield gauge("loraplex:ready", "1 once the model is loaded.", float(engine.ready.is_set()))
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", snap.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", snap.kv_cache_usage)
        yield gauge("loraplex:requests_in_flight", "Engine requests accepted by the server, not finished.",
                    engine.in_flight)
        yield counter("vllm:num_preemptions", "Preempted sequences.", snap.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prefilled prompt tokens.", snap.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", snap.generation_tokens)
        yield counter("loraplex:engine_steps", "Engine steps run.", snap.num_steps)
        yield from _prefix_cache(model, snap)

        llm = engine.engine
        if llm is None:
            return
        yield from self._adapters(llm, model, snap)

    def _adapters(self, llm, model: str, snap):
        info = GaugeMetricFamily(
            "vllm:lora_requests_info", "Adapters of running and waiting requests (value: scrape time).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(llm.config.max_loras), ",".join(sorted(set(snap.running_adapters))),
                         ",".join(sorted(set(snap.waiting_adapters)))], time.time())
        yield info

        adapters = llm.list_adapters()
        resident = GaugeMetricFamily("loraplex:adapter_resident", "1 for the tier each adapter is in.",
                                     labels=["adapter", "tier"])
        nbytes = GaugeMetricFamily("loraplex:adapter_bytes", "Adapter weights in memory (bytes).", labels=["adapter"])
        hits = CounterMetricFamily("loraplex:adapter_hits", "Requests that found the adapter loaded.",
                                   labels=["adapter"])
        pinned = GaugeMetricFamily("loraplex:adapter_pinned", "1 if the adapter is pinned.", labels=["adapter"])
        for a in adapters:
            for tier in TIERS:
                resident.add_metric([a.name, tier], float(a.tier == tier))
            nbytes.add_metric([a.name], float(a.nbytes or 0))
            hits.add_metric([a.name], float(a.hits))
            pinned.add_metric([a.name], float(a.pinned))
        yield from (resident, nbytes, hits, pinned)

        stats = llm.lora_stats()
        cache_hits = CounterMetricFamily("loraplex:lora_cache_hits", "Adapter lookups served by a tier.",
                                         labels=["tier"])
        for tier, n in stats.get("hits", {}).items():
            cache_hits.add_metric([tier], float(n))
        yield cache_hits
        evictions = CounterMetricFamily("loraplex:lora_cache_evictions", "Adapters evicted from a tier.",
                                        labels=["tier"])
        for tier, n in stats.get("evictions", {}).items():
            evictions.add_metric([tier], float(n))
        yield evictions
        for key, doc in (("misses", "Adapter lookups that had to load from disk."),
                         ("loads", "Adapter loads."), ("load_failures", "Adapter loads that failed.")):
            family = CounterMetricFamily(f"loraplex:lora_cache_{key}", doc)
            family.add_metric([], float(stats.get(key, 0)))
            yield family
        yield _histogram("loraplex:adapter_load_seconds", "Adapter load (validate + read) time.",
                         stats.get("load_seconds", []), LOAD_BUCKETS)

        memory = GaugeMetricFamily("loraplex:memory_bytes", "Memory by use (bytes).", labels=["kind"])
        for kind, n in llm.memory_stats().items():
            memory.add_metric([kind], float(n))
        yield memory


def _prefix_cache(model: str, snap):
    """vLLM's prefix-cache counters (tokens of admitted requests looked up / found cached), and
    the same per adapter ('' = base) with the hit rate since start."""
    queries, hits = dict(snap.prefix_cache_queries), dict(snap.prefix_cache_hits)
    for name, doc, values in (
        ("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries),
        ("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).", hits),
    ):
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([model], float(sum(values.values())))
        yield family
    per_queries = CounterMetricFamily("loraplex:adapter_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache, per adapter ('' = base).",
                                      labels=["adapter"])
    per_hits = CounterMetricFamily("loraplex:adapter_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache, per adapter ('' = base).",
                                   labels=["adapter"])
    rate = GaugeMetricFamily("loraplex:adapter_prefix_cache_hit_rate",
                             "Prefix-cache hits / queries (tokens) since start, per adapter ('' = base).",
                             labels=["adapter"])
    for adapter, n in sorted(queries.items()):
        per_queries.add_metric([adapter], float(n))
        per_hits.add_metric([adapter], float(hits.get(adapter, 0)))
        rate.add_metric([adapter], hits.get(adapter, 0) / n if n else 0.0)
    yield from (per_queries, per_hits, rate)


def _histogram(name: str, doc: str, values: list[float], buckets: tuple[float, ...]) -> HistogramMetricFamily:
    counts, cumulative = [], 0
    ordered = sorted(values)
    i = 0
    for bound in buckets:
        while i < len(ordered) and ordered[i] <= bound:
            i += 1
        cumulative = i
        counts.append((str(bound), cumulative))
    counts.append(("+Inf", len(ordered)))
    family = HistogramMetricFamily(name, doc)
    family.add_metric([], counts, sum_value=sum(ordered))
    return family

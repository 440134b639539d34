"""GET /metrics: Prometheus text, vLLM's metric names where vLLM has one.

Every metric we share with vLLM has vLLM's name, type, labels (`model_name` and `engine`, the
engine core's index: always "0" here, one engine per worker) and buckets, as vLLM's v1
PrometheusStatLogger (vllm/v1/metrics/loggers.py) defines them, so a dashboard or alert written
for `vllm serve` reads a worker unchanged; tests/inference/server/test_vllm_metric_names.py holds
the list. Our own metrics are `loraplex:*`.

Latency and per-request token histograms and the finish-reason counter are observed as outputs
reach the event loop. Everything else (queue lengths, KV usage, token totals, tokens per step,
adapter residency, cache hits, memory) is read at scrape time by a collector from the engine
thread's snapshot and the engine's thread-safe adapter stats, so nothing is pushed on the hot
path. Each app has its own CollectorRegistry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from inference.server.async_engine import AsyncEngine, RequestStream, StepOutput
from protocol.worker_api import ADAPTER_TIERS

ENGINE = "0"  # vLLM's `engine` label (data-parallel engine index); one engine per worker here
LABELS = ("model_name", "engine")
# vLLM's buckets (vllm/v1/metrics/loggers.py): seconds, then tokens.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
# End to end and queue time share vLLM's request_latency_buckets.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason strings
LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TIERS = ("device", "host", "loading", "disk", "failed")
BASE_TIER = "base"  # loraplex:adapter_tier_requests' label for a request without an adapter
ARRIVAL_TIERS = (*ADAPTER_TIERS, BASE_TIER)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value (inclusive)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: callable) -> None:
        """model_name(): the served base name (known once the model is loaded)."""
        self.engine = engine
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             LABELS, buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", LABELS,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*LABELS, "finished_reason"], registry=self.registry)
        # The token-count histograms' buckets depend on max_model_len: made by engine_loaded().
        self.prompt_tokens: Histogram | None = None
        self.generation_tokens: Histogram | None = None
        self.adapter_requests = Counter("loraplex:adapter_requests", "Finished requests per adapter ('' = base).",
                                        ["adapter"], registry=self.registry)
        # Cold vs warm starts: where each finished request found its adapter on arrival
        # (RequestOutput.adapter_tier); "base" for base-model requests. Every tier shows from start.
        self.tier_requests = Counter("loraplex:adapter_tier_requests",
                                     "Finished requests by where their adapter was on arrival (device = warm; "
                                     "host, disk = cold; base = no adapter).", ["tier"], registry=self.registry)
        for tier in ARRIVAL_TIERS:
            self.tier_requests.labels(tier)
        self.registry.register(_EngineCollector(self))

    def engine_loaded(self, llm) -> None:
        """Called on the engine thread once the model is loaded (and the served name known),
        before any request: the series vLLM shows from start-up appear, at zero."""
        model = self._model_name()
        buckets = build_1_2_5_buckets(llm.max_model_len)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", LABELS,
                                       buckets=buckets, registry=self.registry)
        self.generation_tokens = Histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           LABELS, buckets=buckets, registry=self.registry)
        for histogram in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens):
            histogram.labels(model, ENGINE)
        for reason in FINISHED_REASONS:
            self.success.labels(model, ENGINE, reason)
        config = llm.config
        budget = config.kv_cache_memory
        # vLLM's CacheConfig fields that apply here, as strings (vLLM's metrics_info()); the KV
        # cache is in the model's dtype, which vLLM calls cache_dtype "auto".
        info = {"block_size": config.block_size, "cache_dtype": "auto",
                "enable_prefix_caching": config.enable_prefix_caching,
                "gpu_memory_utilization": budget if isinstance(budget, float) else None,
                "kv_cache_memory_bytes": budget if isinstance(budget, int) else None,
                "num_gpu_blocks": llm.block_manager.num_blocks, "num_cpu_blocks": None, "engine": ENGINE}
        Gauge("vllm:cache_config_info", "Information of the LLMEngine CacheConfig", list(info),
              registry=self.registry).labels(*map(str, info.values())).set(1)
        # Which matmul path each shape class runs on this CPU (measured at start-up or forced);
        # the "lora" class's path is the LoRA stacks' dtype, "lora_kernel"'s the delta's kernel,
        # "lora_tile_rows"'s from how many tokens of one adapter "amx" multiplies on tiles (0: never),
        # "attention_kernel"'s how decode rows attend, "prefill_attention_kernel"'s how prefill chunks do,
        # "quant_kernel"'s what multiplies int8/int4 weights, "dense_layout"'s how dense weights lie.
        plan = llm.matmul_plan.describe()
        matmul = Gauge("loraplex:matmul_plan_info", "The matmul path per shape class (1), measured at start-up "
                       "or forced with --matmul-path.", ["shape_class", "path", "source", "cpu_capability"],
                       registry=self.registry)
        for shape_class, path in [*plan["paths"].items(), ("lora", plan["lora_dtype"]),
                                  ("lora_kernel", plan["lora_kernel"]),
                                  ("lora_tile_rows", str(plan["lora_tile_rows"])),
                                  ("attention_kernel", plan["attention_kernel"]),
                                  ("prefill_attention_kernel", plan["prefill_attention_kernel"]),
                                  ("quant_kernel", plan["quant_kernel"]),
                                  ("dense_layout", plan["dense_layout"])]:  # fmt: skip
            matmul.labels(shape_class, path, plan["source"], plan["cpu_capability"]).set(1)

    def on_output(self, item: StepOutput, stream: RequestStream) -> None:
        """Called on the event loop for every engine output before its stream sees it."""
        out = item.output
        labels = (self._model_name(), ENGINE)
        if out.delta_token_ids:
            previous = stream.last_output_time.get(out.request_id)
            if previous is None:
                if out.time_to_first_token is not None:
                    self.ttft.labels(*labels).observe(out.time_to_first_token)
                # The rest of the first output's tokens (a multi-token step) have no gap to report.
            else:
                gap = (item.time - previous) / len(out.delta_token_ids)
                for _ in out.delta_token_ids:
                    self.itl.labels(*labels).observe(gap)
        if out.finished:
            if out.latency is not None:
                self.e2e.labels(*labels).observe(out.latency)
            if out.queue_time is not None:
                self.queue_time.labels(*labels).observe(out.queue_time)
            if self.prompt_tokens is not None:
                self.prompt_tokens.labels(*labels).observe(out.usage.prompt_tokens)
                self.generation_tokens.labels(*labels).observe(out.usage.completion_tokens)
            self.success.labels(*labels, out.finish_reason or "unknown").inc()
            self.adapter_requests.labels(stream.adapter_name or "").inc()
            self.tier_requests.labels(out.adapter_tier or BASE_TIER).inc()


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self):
        engine = self.m.engine
        model = self.m._model_name()
        snap = engine.snapshot

        def gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        def counter(name: str, doc: str, value: float, labels: dict[str, str]) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=list(labels))
            family.add_metric(list(labels.values()), value)
            return family

        ours = {"model_name": model}
        vllm = {"model_name": model, "engine": ENGINE}
        yield gauge("loraplex:ready", "1 once the model is loaded.", float(engine.ready.is_set()), ours)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", snap.num_running,
                    vllm)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", snap.num_waiting, vllm)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", snap.kv_cache_usage,
                    vllm)
        yield gauge("loraplex:requests_in_flight", "Engine requests accepted by the server, not finished.",
                    engine.in_flight, ours)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                      snap.num_preemptions, vllm)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", snap.prompt_tokens, vllm)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", snap.generation_tokens,
                      vllm)
        yield counter("loraplex:engine_steps", "Engine steps run.", snap.num_steps, ours)
        yield _histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                         snap.iteration_tokens, ITERATION_TOKENS_BUCKETS, vllm)
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
                         [(seconds, 1) for seconds in stats.get("load_seconds", [])], LOAD_BUCKETS)

        memory = GaugeMetricFamily("loraplex:memory_bytes", "Memory by use (bytes).", labels=["kind"])
        for kind, n in llm.memory_stats().items():
            memory.add_metric([kind], float(n))
        yield memory


def _prefix_cache(model: str, snap):
    """vLLM's prefix-cache counters (tokens of admitted requests looked up / found cached), and
    the same per adapter ('' = base) with the hit rate since start."""
    queries, hits = dict(snap.prefix_cache_queries), dict(snap.prefix_cache_hits)
    for name, doc, values in (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", hits),
    ):
        family = CounterMetricFamily(name, doc, labels=list(LABELS))
        family.add_metric([model, ENGINE], float(sum(values.values())))
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


def _histogram(name: str, doc: str, counts: list[tuple[float, int]] | tuple[tuple[float, int], ...],
               buckets: tuple[float, ...], labels: dict[str, str] | None = None) -> HistogramMetricFamily:
    """A histogram family from (value, how many times it was seen) pairs."""
    labels = labels or {}
    cumulative = []
    for bound in buckets:
        cumulative.append((str(float(bound)), sum(n for value, n in counts if value <= bound)))
    cumulative.append(("+Inf", sum(n for _, n in counts)))
    family = HistogramMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), cumulative, sum_value=float(sum(value * n for value, n in counts)))
    return family

"""A real worker's /metrics against vLLM's: every metric we share with `vllm serve` has vLLM's
name, type, labels and buckets, so dashboards and alerts written for vLLM read a worker unchanged.

The list below was read off vLLM's v1 PrometheusStatLogger (vllm-project/vllm,
vllm/v1/metrics/loggers.py: labelnames ["model_name", "engine"], request_latency_buckets,
build_1_2_5_buckets(max_model_len), the iteration-token buckets, FinishReason's strings) and
the "Production Metrics" page of vLLM's documentation; it is not derived from our code.
Every `vllm:` family the worker exports must be on it: our own metrics are `loraplex:`.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.inference.server.conftest import TINY

VLLM = {"model_name", "engine"}
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
TOKENS = "1-2-5 up to max_model_len"  # vLLM's build_1_2_5_buckets(max_model_len)

# family name (as prometheus_client's parser names it: counters without _total) -> (type, labels, buckets)
SHARED = {
    "vllm:num_requests_running": ("gauge", VLLM, None),
    "vllm:num_requests_waiting": ("gauge", VLLM, None),
    "vllm:kv_cache_usage_perc": ("gauge", VLLM, None),
    "vllm:prefix_cache_queries": ("counter", VLLM, None),
    "vllm:prefix_cache_hits": ("counter", VLLM, None),
    "vllm:num_preemptions": ("counter", VLLM, None),
    "vllm:prompt_tokens": ("counter", VLLM, None),
    "vllm:generation_tokens": ("counter", VLLM, None),
    "vllm:request_success": ("counter", VLLM | {"finished_reason"}, None),
    "vllm:request_prompt_tokens": ("histogram", VLLM, TOKENS),
    "vllm:request_generation_tokens": ("histogram", VLLM, TOKENS),
    "vllm:iteration_tokens_total": ("histogram", VLLM, ITERATION_TOKENS),
    "vllm:time_to_first_token_seconds": ("histogram", VLLM, TTFT),
    "vllm:inter_token_latency_seconds": ("histogram", VLLM, ITL),
    "vllm:e2e_request_latency_seconds": ("histogram", VLLM, REQUEST_LATENCY),
    "vllm:request_queue_time_seconds": ("histogram", VLLM, REQUEST_LATENCY),
    "vllm:lora_requests_info": ("gauge", {"max_lora", "waiting_lora_adapters", "running_lora_adapters"}, None),
    # An info gauge (value 1): vLLM's CacheConfig fields as labels, plus engine; these apply here.
    "vllm:cache_config_info": ("gauge", {"block_size", "cache_dtype", "enable_prefix_caching",
                                         "gpu_memory_utilization", "num_gpu_blocks", "engine"}, None),
}
FINISHED_REASONS = {"stop", "length", "abort", "error"}  # str(vllm.v1.engine.FinishReason)


def one_two_five(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... <= limit, written out independently of the worker's code."""
    out, scale = [], 1
    while scale <= limit:
        out += [float(m * scale) for m in (1, 2, 5) if m * scale <= limit]
        scale *= 10
    return out


def scrape(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {family.name: family for family in text_string_to_metric_families(text)}


def test_every_metric_shared_with_vllm_has_vllms_name_type_labels_and_buckets(lora_server):
    url = lora_server.url
    max_model_len = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    before = scrape(url)
    answer = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": TINY, "prompt": "t5 t6 t7 t8", "max_tokens": 3, "ignore_eos": True})
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    families = scrape(url)

    for name, (kind, labels, buckets) in SHARED.items():
        assert name in families, f"{name} is not exported"
        family = families[name]
        assert family.type == kind, f"{name}: {family.type}, vLLM's is {kind}"
        assert family.samples, f"{name} has no samples"
        seen = {label for s in family.samples for label in s.labels} - {"le"}
        assert labels <= seen, f"{name}: labels {sorted(seen)}, vLLM's include {sorted(labels)}"
        if name != "vllm:cache_config_info":
            assert seen == labels, f"{name}: labels {sorted(seen)}, vLLM's are {sorted(labels)}"
        if "engine" in labels:
            assert {s.labels["engine"] for s in family.samples} == {"0"}, name
        if "model_name" in labels:
            assert {s.labels["model_name"] for s in family.samples} == {TINY}, name
        if buckets is not None:
            expected = one_two_five(max_model_len) if buckets == TOKENS else [float(b) for b in buckets]
            les = [s.labels["le"] for s in family.samples if s.name == f"{name}_bucket"]
            assert les[-1] == "+Inf" and [float(le) for le in les[:-1]] == expected, f"{name}: buckets {les}"

    # (`X_created` families: prometheus_client's creation timestamps of X, which vLLM's client writes too.)
    exported = {name for name in families if name.startswith("vllm:") and not name.endswith("_created")}
    assert exported <= set(SHARED), f"vllm: names vLLM does not export: {sorted(exported - set(SHARED))}"

    success = families["vllm:request_success"]
    assert {s.labels["finished_reason"] for s in success.samples} == FINISHED_REASONS  # at 0 from start-up
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1 and info.labels["block_size"] == "16" and info.labels["enable_prefix_caching"] == "True"

    # The request just served landed in the new histograms: its prompt, 3 generated, queued once.
    def count(fams: dict, name: str, suffix: str = "_count") -> float:
        return sum(s.value for s in fams[name].samples if s.name == name + suffix)

    assert (count(families, "vllm:request_prompt_tokens", "_sum")
            - count(before, "vllm:request_prompt_tokens", "_sum")) == usage["prompt_tokens"]
    assert (count(families, "vllm:request_generation_tokens", "_sum")
            - count(before, "vllm:request_generation_tokens", "_sum")) == 3
    assert count(families, "vllm:request_queue_time_seconds") - count(before, "vllm:request_queue_time_seconds") == 1
    # 3 steps at least (prefill + 2 decodes), each running >= 1 token.
    assert count(families, "vllm:iteration_tokens_total") - count(before, "vllm:iteration_tokens_total") >= 3
    assert (count(families, "vllm:iteration_tokens_total", "_sum")
            - count(before, "vllm:iteration_tokens_total", "_sum")) >= usage["prompt_tokens"] + 2
    length = [s.value for s in success.samples if s.name.endswith("_total") and s.labels["finished_reason"] == "length"]
    assert length and length[0] >= 1

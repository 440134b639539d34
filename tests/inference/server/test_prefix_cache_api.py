"""Prefix caching over HTTP on the tiny model: `cache_salt` on chat and completions keeps two
salts apart, usage reports the cached prompt tokens (OpenAI's prompt_tokens_details), a bad salt
is a 400 naming it, /metrics carries vLLM's prefix-cache counters and the per-adapter hit rate,
and the flag spelled as vLLM spells it turns the cache off."""

from __future__ import annotations

import argparse
import re

import httpx
import pytest

from inference.server.cli import add_serve_parser, engine_config
from protocol.worker_api import CACHE_SALT_MAX
from tests.inference.server.conftest import TINY

PROMPT = [(11 * i + 5) % 290 + 5 for i in range(45)]  # 45 tokens: 2 full blocks + 13


def complete(server, body: dict, route: str = "/v1/completions") -> httpx.Response:
    base = {"model": TINY, "max_tokens": 4, "temperature": 0}
    return httpx.post(f"{server.url}{route}", json={**base, **body}, timeout=60)


def cached_tokens(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_repeated_prompt_is_served_from_the_cache_only_under_the_same_salt(lora_server):
    first = complete(lora_server, {"prompt": PROMPT, "cache_salt": "tenant-one"})
    again = complete(lora_server, {"prompt": PROMPT, "cache_salt": "tenant-one"})
    other = complete(lora_server, {"prompt": PROMPT, "cache_salt": "tenant-two"})
    assert cached_tokens(first) == 0
    assert cached_tokens(again) == 32
    assert cached_tokens(other) == 0  # the same tokens, another tenant: computed again
    texts = {r.json()["choices"][0]["text"] for r in (first, again, other)}
    assert len(texts) == 1


def test_chat_takes_a_cache_salt_and_an_adapter_has_its_own_cache(lora_server):
    words = " ".join(f"t{t}" for t in PROMPT)
    body = {"messages": [{"role": "user", "content": words}], "cache_salt": "chat-salt"}
    route = "/v1/chat/completions"
    assert cached_tokens(complete(lora_server, {**body, "model": "ad0"}, route)) == 0
    assert cached_tokens(complete(lora_server, {**body, "model": "ad0"}, route)) >= 32
    assert cached_tokens(complete(lora_server, body, route)) == 0  # the base never reads ad0's KV


@pytest.mark.parametrize("salt", ["", 12, ["a"], "x" * (CACHE_SALT_MAX + 1)])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_bad_cache_salt_is_a_400_naming_it(lora_server, salt, route):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "t5"}]}
    response = complete(lora_server, {**body, "cache_salt": salt}, route)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "cache_salt", error


def metric(text: str, name: str, labels: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{{re.escape(labels)}}} (\S+)$", text, re.MULTILINE)
    assert match, f"{name}{{{labels}}} not in /metrics"
    return float(match.group(1))


def test_metrics_count_prefix_cache_tokens_the_vllm_way_and_per_adapter(lora_server):
    before = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    complete(lora_server, {"prompt": PROMPT, "cache_salt": "metrics", "model": "ad0"})
    complete(lora_server, {"prompt": PROMPT, "cache_salt": "metrics", "model": "ad0"})
    after = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    model = f'engine="0",model_name="{TINY}"'
    assert "# TYPE vllm:prefix_cache_queries_total counter" in after
    queries = metric(after, "vllm:prefix_cache_queries_total", model) - metric(
        before, "vllm:prefix_cache_queries_total", model
    )
    hits = metric(after, "vllm:prefix_cache_hits_total", model) - metric(before, "vllm:prefix_cache_hits_total", model)
    assert (queries, hits) == (2 * len(PROMPT), 32)
    assert metric(after, "loraplex:adapter_prefix_cache_hits_total", 'adapter="ad0"') >= 32
    rate = metric(after, "loraplex:adapter_prefix_cache_hit_rate", 'adapter="ad0"')
    assert 0 < rate < 1


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_enable_prefix_caching_flag_as_vllm_spells_it(tiny_lora, monkeypatch):
    base, _ = tiny_lora
    monkeypatch.delenv("INFERENCE_ENABLE_PREFIX_CACHING", raising=False)
    assert engine_config(serve_args("--model", str(base))).enable_prefix_caching is True
    assert engine_config(serve_args("--model", str(base), "--no-enable-prefix-caching")).enable_prefix_caching is False
    monkeypatch.setenv("INFERENCE_ENABLE_PREFIX_CACHING", "false")
    assert engine_config(serve_args("--model", str(base))).enable_prefix_caching is False
    assert engine_config(serve_args("--model", str(base), "--enable-prefix-caching")).enable_prefix_caching is True

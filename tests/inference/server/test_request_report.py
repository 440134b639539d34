"""The worker's report on each request (protocol.worker_api.RequestReport under REPORT_KEY): in a
non-streamed answer and in the streamed usage chunk, where the adapter was found on arrival
(device when it is still in a slot, "" for the base model), the queue time, the time to first
token and the mean inter-token gap (None for a single token); the openai SDK parses the answer
as usual; loraplex:adapter_tier_requests counts requests by tier. The tiny model's server."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from protocol.worker_api import REPORT_KEY, RequestReport
from tests.inference.server.conftest import TINY

PROMPT = "t5 t17 t3 t99 t42"


def post(server, body: dict, route: str = "/v1/completions") -> httpx.Response:
    base = {"model": TINY, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    # (a None in body removes the default: chat takes messages, not a prompt)
    request = {k: v for k, v in {**base, **body}.items() if v is not None}
    response = httpx.post(f"{server.url}{route}", json=request, timeout=60)
    assert response.status_code == 200, response.text
    return response


def check_times(report: dict, *, tokens: int) -> None:
    assert set(report) == {"adapter_tier", "queue_ms", "ttft_ms", "inter_token_ms"}
    assert 0 <= report["queue_ms"] <= report["ttft_ms"]
    if tokens >= 2:
        assert report["inter_token_ms"] > 0
    else:
        assert report["inter_token_ms"] is None  # no gap between tokens to measure
    assert RequestReport.from_json(report) == RequestReport(**report)  # what the gateway reads back


def test_a_repeated_adapter_is_warm_and_the_base_has_no_tier(lora_server):
    before = lora_server.metric("loraplex:adapter_tier_requests_total", tier="device")
    base_before = lora_server.metric("loraplex:adapter_tier_requests_total", tier="base")
    post(lora_server, {"model": "ad0"})  # wherever ad0 was, it is in a slot now
    again = post(lora_server, {"model": "ad0"}).json()[REPORT_KEY]
    assert again["adapter_tier"] == "device"
    check_times(again, tokens=4)
    base = post(lora_server, {"max_tokens": 1}).json()[REPORT_KEY]
    assert base["adapter_tier"] == ""
    check_times(base, tokens=1)
    assert lora_server.metric("loraplex:adapter_tier_requests_total", tier="device") >= before + 1
    assert lora_server.metric("loraplex:adapter_tier_requests_total", tier="base") == base_before + 1


def test_the_report_rides_in_the_usage_chunk_of_a_stream_only(lora_server):
    stream = {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    chat = {"messages": [{"role": "user", "content": PROMPT}], "prompt": None}
    for route, body in (("/v1/completions", stream), ("/v1/chat/completions", {**stream, **chat})):
        response = post(lora_server, body, route)
        chunks = [json.loads(line[5:]) for line in response.text.splitlines()
                  if line.startswith("data:") and line != "data: [DONE]"]
        *content, last = chunks
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3
        check_times(last[REPORT_KEY], tokens=3)
        assert all(REPORT_KEY not in chunk for chunk in content)


def test_the_openai_sdk_parses_an_answer_with_the_report(lora_server):
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="x", max_retries=0, timeout=60)
    completion = client.completions.create(model="ad0", prompt=PROMPT, max_tokens=2, temperature=0)
    assert completion.usage.completion_tokens == 2 and completion.choices[0].text
    assert completion.model_extra[REPORT_KEY]["adapter_tier"] in ("device", "host", "disk")


def test_a_request_with_several_choices_reports_the_coldest_and_slowest():
    from inference.server.serving import Choice, report

    def choice(index, tier, queue, ttft, latency, tokens):
        return Choice(index=index, prompt_index=0, token_ids=list(range(tokens)), adapter_tier=tier,
                      queue_time=queue, time_to_first_token=ttft, latency=latency)

    choices = {"r0": choice(0, "device", 0.001, 0.010, 0.050, 5),  # 40 ms over 4 gaps
               "r1": choice(1, "host", 0.003, 0.020, 0.080, 7),  # 60 ms over 6 gaps
               "r2": choice(2, "device", 0.002, 0.015, 0.015, 1)}  # one token: no gap
    assert report(choices) == {"adapter_tier": "host", "queue_ms": pytest.approx(3.0), "ttft_ms": pytest.approx(10.0),
                               "inter_token_ms": pytest.approx(10.0)}
    assert report({"r2": choices["r2"]})["inter_token_ms"] is None
    assert report({"r": Choice(index=0, prompt_index=0)}) == RequestReport().to_json()  # never scheduled

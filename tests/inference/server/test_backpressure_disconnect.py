"""Backpressure (a full worker answers 503 + Retry-After) and client disconnects (the request is
aborted at once: its KV blocks are free again, seen in /metrics)."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.inference.server.conftest import MAX_NUM_SEQS, MAX_WAITING, SERVED

LONG = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0.8,
        "ignore_eos": True, "stream": True}


def _wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _idle(server) -> bool:
    return (server.metric("vllm:num_requests_running") == 0 and server.metric("vllm:num_requests_waiting") == 0
            and server.metric("loraplex:requests_in_flight") == 0 and server.metric("vllm:kv_cache_usage_perc") == 0)


def test_disconnect_mid_stream_frees_the_kv_cache(server, client):
    _wait_for(lambda: _idle(server))
    stream = client.completions.create(**{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    assert server.metric("vllm:num_requests_running") == 1
    assert server.metric("vllm:kv_cache_usage_perc") > 0
    stream.close()  # the client goes away mid-stream
    _wait_for(lambda: _idle(server), timeout=10)
    assert server.metric("vllm:request_success_total", finished_reason="abort") >= 1


async def test_a_full_worker_answers_503_with_retry_after_and_disconnects_free_everything(server):
    _wait_for(lambda: _idle(server))
    capacity = MAX_NUM_SEQS + MAX_WAITING
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        release = asyncio.Event()

        async def hold_stream() -> None:
            async with http.stream("POST", "/v1/completions", json=LONG) as r:
                assert r.status_code == 200
                await release.wait()

        holders = [asyncio.create_task(hold_stream()) for _ in range(capacity)]

        def full() -> bool:  # every slot taken and the waiting queue at its bound
            return (server.metric("loraplex:requests_in_flight") == capacity
                    and server.metric("vllm:num_requests_waiting") >= MAX_WAITING)

        await asyncio.to_thread(_wait_for, full, 60)

        r = await http.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 1})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_overloaded"
        with pytest.raises(openai.APIStatusError) as e:
            sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            await sdk.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=1)
        assert e.value.status_code == 503

        for task in holders:  # every client hangs up: running and waiting requests alike
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    await asyncio.to_thread(_wait_for, lambda: _idle(server), 15)

"""Fair scheduling through the server: the `tenant` field reaches the engine's weighted fair
queue. With one batch slot the finish order is the admission order; tenant A queues 10x the
requests of tenant B, yet B is admitted at its share, not after all of A's."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.inference.server.server_process import start_server
from tests.inference.server.tiny_lora import word_prompt


@pytest.fixture(scope="module")
def serial_server(tiny_lora, tmp_path_factory):
    base, _ = tiny_lora
    proc = start_server(["--model", str(base), "--served-model-name", "tiny", "--dtype", "float32",
                         "--kv-cache-memory", "4MiB", "--max-num-seqs", "1", "--max-waiting-requests", "64"],
                        tmp_path_factory.mktemp("server") / "serial.log")
    yield proc
    proc.stop()


async def test_a_flooding_tenant_does_not_starve_another(serial_server):
    url = serial_server.url
    order: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def blocker() -> None:  # holds the only slot while the queue fills
            async with http.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": "t5", "max_tokens": 5000, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                await asyncio.sleep(3600)

        async def request(tenant: str, i: int) -> None:
            r = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": word_prompt(i, 8), "max_tokens": 8, "ignore_eos": True,
                "temperature": 0, "tenant": tenant})
            assert r.status_code == 200, r.text
            order.append(tenant)

        hold = asyncio.create_task(blocker())
        await asyncio.to_thread(_wait_for, lambda: serial_server.metric("vllm:num_requests_running") == 1)
        tasks = [asyncio.create_task(request("A", i)) for i in range(20)]
        await asyncio.to_thread(_wait_for, lambda: serial_server.metric("vllm:num_requests_waiting") == 20)
        tasks += [asyncio.create_task(request("B", 100 + i)) for i in range(2)]
        await asyncio.to_thread(_wait_for, lambda: serial_server.metric("vllm:num_requests_waiting") == 22)
        hold.cancel()  # the blocker hangs up: the queue drains one request at a time
        await asyncio.gather(*tasks)
        await asyncio.gather(hold, return_exceptions=True)
    # Equal weights: while both are backlogged B gets every other admission, so both of B's
    # requests are among the first few (FCFS would put them last, at 21 and 22).
    b_positions = [i + 1 for i, t in enumerate(order) if t == "B"]
    assert len(order) == 22 and max(b_positions) <= 5, order


def _wait_for(check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)

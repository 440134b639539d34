"""SIGTERM drains a worker: /ready turns 503 and new requests are refused (503 worker_draining,
Retry-After) while the port stays open, the streams already admitted run to their end, and the
process exits 0 once nothing is in flight; past --shutdown-grace-seconds what still runs is cut
with an error (an SSE error event, or a 503 when nothing was sent yet) and the process exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.inference.server.server_process import ROOT, ServerProcess, start_server
from tests.sse_stream import SseStream

SERVED = "smollm2"
GRACE = 120  # long enough for a loaded 2-core box; the worker must exit well before it
FLAGS = ["--served-model-name", SERVED, "--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-num-seqs", "8"]


def start(smollm2_path, tmp_path, grace: str) -> ServerProcess:
    return start_server(["--model", str(smollm2_path), *FLAGS, "--shutdown-grace-seconds", grace],
                        tmp_path / "worker.log")


def start_streams(url: str, count: int, max_tokens: int) -> list[SseStream]:
    body = {"model": SERVED, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    streams = [SseStream(f"{url}/v1/completions", body) for _ in range(count)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120), "a stream never started"
        assert s.failure is None, s.failure
    return streams


def test_sigterm_lets_every_admitted_stream_finish_and_refuses_new_work(smollm2_path, tmp_path):
    worker = start(smollm2_path, tmp_path, str(GRACE))
    try:
        streams = start_streams(worker.url, 8, max_tokens=48)
        assert all(not s.done for s in streams), "the streams ended before the drain began: make them longer"
        worker.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # The port still answers while draining: not ready, and new work is refused before any byte.
        ready = httpx.get(f"{worker.url}/ready", timeout=10)
        assert ready.status_code == 503 and ready.json() == {"status": "draining"}
        assert httpx.get(f"{worker.url}/health", timeout=10).status_code == 200  # alive: no restart wanted
        refused = httpx.post(f"{worker.url}/v1/completions", timeout=10,
                             json={"model": SERVED, "prompt": "Hi", "max_tokens": 4})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "worker_draining" and error["type"] == "service_unavailable"
        assert "shutting down" in error["message"]

        for s in streams:
            s.join(GRACE)
            assert s.failure is None, s.failure
            assert s.done and s.errors == [] and s.finish_reasons == ["length"]
        assert worker.proc.wait(GRACE) == 0, worker.log
        assert time.monotonic() - signalled < GRACE  # it left once the streams ended, not at the deadline
        assert "draining 8 request(s) in flight" in worker.log
    finally:
        worker.stop()


def test_past_the_grace_period_running_requests_are_cut_and_the_worker_exits(smollm2_path, tmp_path):
    worker = start(smollm2_path, tmp_path, "1")
    try:
        streams = start_streams(worker.url, 2, max_tokens=600)
        holder: dict = {}
        # A non-streaming request in flight too: nothing was sent yet, so it gets a plain 503.
        plain = threading.Thread(target=lambda: holder.update(response=httpx.post(
            f"{worker.url}/v1/completions", timeout=120,
            json={"model": SERVED, "prompt": "Hello", "max_tokens": 600, "ignore_eos": True})), daemon=True)
        plain.start()
        time.sleep(0.5)
        worker.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert worker.proc.wait(20) == 0, worker.log
        assert time.monotonic() - signalled < 1 + 8  # the grace, then a prompt shutdown

        for s in streams:
            s.join(10)
            assert s.failure is None, s.failure
            assert s.done and s.finish_reasons == []
            [error] = s.errors
            assert error["code"] == "worker_draining" and "shut down before this request finished" in error["message"]
        plain.join(10)
        response = holder["response"]
        assert response.status_code == 503 and response.json()["error"]["code"] == "worker_draining"
        assert "request(s) cut off" in worker.log
    finally:
        worker.stop()


@pytest.mark.parametrize(("env", "args", "needle"), [
    ({}, ["--shutdown-grace-seconds", "soon"], "--shutdown-grace-seconds: expected a number of seconds"),
    ({}, ["--shutdown-grace-seconds", "-1"], "--shutdown-grace-seconds: must be a finite number >= 0"),
    ({"INFERENCE_SHUTDOWN_GRACE_SECONDS": "inf"}, [], "INFERENCE_SHUTDOWN_GRACE_SECONDS: must be a finite number"),
])
def test_a_bad_grace_is_one_line_and_exit_2(env, args, needle, smollm2_path):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("INFERENCE_")} | env
    result = subprocess.run([sys.executable, "-m", "inference", "serve", "--model", str(smollm2_path), *args],
                            capture_output=True, text=True, cwd=ROOT, env=environ, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith(f"config error: {needle}"), result.stderr

"""A worker drained by SIGTERM behind the gateway: the 8 streams it holds finish, requests that
arrive meanwhile are refused by it (503 worker_draining, or the connection once it has closed)
and served by the other worker, and no client sees an error."""

from __future__ import annotations

import itertools
import signal

import pytest

from portal.fleet.selectors import rendezvous_score, route_candidates, routing_key
from tests.inference.server import server_process
from tests.portal.gateway.conftest import (
    ADMIN_TOKEN,
    BASE,
    WORKER_FLAGS,
    chat_prefix_key,
    model_path,
    sdk,
    usage_rows,
    wait_until,
)
from tests.sse_stream import SseStream

GRACE = 120
STREAM = {"model": BASE, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 64,
          "ignore_eos": True, "stream": True}


@pytest.fixture
def first_in_line(tmp_path_factory, worker, acme, monkeypatch):
    """A second worker on a port the rendezvous order of acme's story chat puts ahead of the
    session's, with a grace long enough for a loaded 2-core box (it must exit long before it anyway)."""
    key = routing_key(None, chat_prefix_key(acme.tenant, STREAM["messages"]))
    # searched until found (a bounded search fails whenever the worker's URL ranks near the top)
    port = next(p for p in (server_process.free_port() for _ in itertools.count())
                if rendezvous_score(key, f"http://127.0.0.1:{p}") > rendezvous_score(key, worker.url))
    monkeypatch.setattr(server_process, "free_port", lambda: port)
    proc = server_process.start_server(
        ["--model", str(model_path()), *WORKER_FLAGS, "--shutdown-grace-seconds", str(GRACE)],
        tmp_path_factory.mktemp("worker") / "drained.log", env={"INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN})
    monkeypatch.undo()
    yield proc
    proc.stop()


def test_sigterm_drains_a_worker_without_a_client_seeing_an_error(acme, worker, live, settings, first_in_line):
    from portal.gateway.resolve import base_model_forget

    settings.INFERENCE_URLS = [worker.url, first_in_line.url]
    base_model_forget()
    prefix = chat_prefix_key(acme.tenant, STREAM["messages"])
    assert route_candidates(lora_name=None, prefix_key=prefix)[0].url == first_in_line.url

    streams = [SseStream(f"{live.url}/v1/chat/completions", STREAM, {"authorization": f"Bearer {acme.key}"}) for _ in range(8)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.started.wait(120) and s.failure is None, s.failure
    assert first_in_line.metric("vllm:num_requests_running") == 8
    first_in_line.proc.send_signal(signal.SIGTERM)

    # Sent while it drains: the first worker in line refuses (503 before any byte), the other serves.
    client = sdk(live, acme.key)

    def ask() -> None:
        raw = client.chat.completions.with_raw_response.create(  # the same chat: the same first worker
            model=BASE, messages=STREAM["messages"], max_tokens=4)
        assert raw.status_code == 200 and raw.parse().choices[0].message.content is not None

    for _ in range(2):
        ask()

    for s in streams:
        s.join(GRACE)
        assert s.failure is None, s.failure
        assert s.done and s.errors == []
        assert s.finish_reasons[-1] == "length"
    assert first_in_line.proc.wait(30) == 0, first_in_line.log
    assert '"POST /v1/chat/completions HTTP/1.1" 503' in first_in_line.log  # (its access log, flushed at exit)
    # Gone now: its port refuses connections, and the gateway goes on to the other worker.
    for _ in range(3):
        ask()

    rows = wait_until(lambda: len(found := usage_rows(tenant=acme.tenant)) == 13 and found)
    assert all(r.status_code == 200 and r.error == "" and not r.client_disconnected for r in rows)
    assert sorted(r.worker_url for r in rows if r.stream) == [first_in_line.url] * 8
    assert [r.worker_url for r in rows if not r.stream] == [worker.url] * 5

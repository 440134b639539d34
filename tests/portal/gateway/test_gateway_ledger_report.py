"""What the ledger learns of each request beyond tokens, through the live gateway and worker:
where the worker found the adapter (disk on first use, host when swapped back into a slot,
device when it stayed there, "" for the base), the worker's queue time, the inter-token gap,
the error code a refused request was answered with, and how many workers were tried. The
worker's report travels in its answer (protocol.worker_api.REPORT_KEY) and never reaches the
client: raw JSON, SSE and the openai SDK see OpenAI's shapes only."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from protocol.worker_api import REPORT_KEY
from tests.inference.server.server_process import start_server
from tests.portal.gateway.conftest import (
    ADMIN_TOKEN,
    BASE,
    WORKER_FLAGS,
    direct,
    model_path,
    sdk,
    wait_for_row,
)
from tests.portal.gateway.lora_adapter import write_adapter

MESSAGES = [{"role": "user", "content": "Name a colour."}]
CHAT = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    # Seeds no other test uses: each adapter's content id is new to the session's worker.
    root = tmp_path_factory.mktemp("tiers")
    return [write_adapter(root / name, model_path(), seed=seed) for name, seed in (("a", 2101), ("b", 2102),
                                                                                    ("c", 2103))]


def chat(client, model: str, **extra):
    """(the parsed answer, its ledger row); a streamed answer's chunks instead of the answer."""
    if extra.get("stream"):
        stream = client.chat.completions.create(model=model, **{**CHAT, **extra})
        chunks = list(stream)
        return chunks, wait_for_row(stream.response.headers["x-request-id"])
    raw = client.chat.completions.with_raw_response.create(model=model, **{**CHAT, **extra})
    return raw.parse(), wait_for_row(raw.headers["x-request-id"])


def test_cold_and_warm_starts_reach_the_ledger(acme, live, adapter_dirs):
    from portal.adapters.models import Adapter, AdapterVersion

    models = []
    for name, directory in zip("abc", adapter_dirs, strict=True):
        adapter = Adapter.objects.create(tenant=acme.tenant, name=f"tier-{name}")
        AdapterVersion.objects.create(adapter=adapter, number=1, source_path=str(directory))
        models.append(f"acme/tier-{name}")
    a, b, c = models
    client = sdk(live, acme.key)
    # The worker has 2 device slots (at most one of them pinned by other tests): a, b and c in turn
    # leave c and one other in the slots, a the least recently used, so a is swapped back in.
    rows = [chat(client, model)[1] for model in (a, b, c, a)]
    assert [r.adapter_tier for r in rows] == ["disk", "disk", "disk", "host"]
    chunks, streamed = chat(client, a, stream=True)  # the same adapter again: still in its slot
    assert streamed.adapter_tier == "device"
    base = chat(client, BASE)[1]
    assert base.adapter_tier == ""
    for row in (*rows, streamed, base):
        assert row.status_code == 200 and row.error_code == "" and row.upstream_attempts == 1
        assert row.completion_tokens == 4
        assert row.queue_ms is not None and 0 <= row.queue_ms <= row.latency_ms
        # four tokens: three gaps, each shorter than the whole request
        assert row.inter_token_ms is not None and 0 < row.inter_token_ms * 3 <= row.latency_ms


@pytest.fixture(scope="module")
def one_slot_worker(tmp_path_factory, gateway_port):
    """The worker as the session's, with one device slot (--max-loras 1)."""
    flags = list(WORKER_FLAGS)
    flags[flags.index("--max-loras") + 1] = "1"
    log = tmp_path_factory.mktemp("worker") / "one-slot.log"
    proc = start_server(["--model", str(model_path()), *flags], log, env={
        "INFERENCE_ADMIN_TOKEN": ADMIN_TOKEN, "INFERENCE_PORTAL_ORIGINS": f"http://127.0.0.1:{gateway_port}"})
    yield proc
    proc.stop()


def test_with_one_slot_two_adapters_in_turn_are_cold_every_time(acme, live, settings, one_slot_worker, adapter_dirs):
    """The seeds' case: more adapters in use than device slots. Each request for the other
    adapter finds it out of the slot (read from disk the first time, copied from host memory
    after), and the ledger says so; the same adapter twice in a row is warm."""
    from portal.adapters.models import Adapter, AdapterVersion
    from portal.gateway.resolve import base_model_forget

    settings.INFERENCE_URLS = [one_slot_worker.url]
    base_model_forget()
    models = []
    for name, directory in zip("xy", adapter_dirs, strict=False):
        adapter = Adapter.objects.create(tenant=acme.tenant, name=f"slot-{name}")
        AdapterVersion.objects.create(adapter=adapter, number=1, source_path=str(directory))
        models.append(f"acme/slot-{name}")
    x, y = models
    client = sdk(live, acme.key)
    rows = [chat(client, model)[1] for model in (x, y, x, y, y)]
    assert [r.adapter_tier for r in rows] == ["disk", "disk", "host", "host", "device"]
    assert all(r.worker_url == one_slot_worker.url and r.status_code == 200 for r in rows)


def test_one_token_has_no_inter_token_gap(acme, live):
    client = sdk(live, acme.key)
    for stream in (False, True):
        _, row = chat(client, BASE, max_tokens=1, stream=stream)
        assert row.completion_tokens == 1 and row.inter_token_ms is None
        assert row.queue_ms is not None and row.queue_ms >= 0


def test_the_client_never_sees_the_workers_report(acme, worker, live):
    body = {"model": BASE, **CHAT}
    assert REPORT_KEY in direct(worker, "/v1/chat/completions", body)  # the worker does send it
    headers = {"authorization": f"Bearer {acme.key}"}
    answer = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200 and REPORT_KEY not in answer.json() and answer.json()["usage"]
    for options in ({"include_usage": True}, None):
        streamed = {**body, "stream": True, **({"stream_options": options} if options else {})}
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=streamed, headers=headers,
                          timeout=120) as response:
            chunks = [json.loads(line[5:]) for line in response.iter_lines()
                      if line.startswith("data:") and line != "data: [DONE]"]
        assert all(REPORT_KEY not in chunk for chunk in chunks)
        assert any(chunk.get("usage") for chunk in chunks) == bool(options)
        row = wait_for_row(response.headers["x-request-id"])
        assert row.queue_ms is not None  # read from the usage chunk the client did not get
    client = sdk(live, acme.key)
    completion = client.chat.completions.create(model=BASE, **CHAT)
    assert REPORT_KEY not in (completion.model_extra or {})
    stream = client.chat.completions.create(model=BASE, stream=True, stream_options={"include_usage": True},
                                            **CHAT)
    assert all(REPORT_KEY not in (chunk.model_extra or {}) for chunk in stream)


def test_refusals_record_their_error_code_and_no_worker(acme, live):
    client = sdk(live, acme.key)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.with_raw_response.create(model="acme/no-such-adapter", **CHAT)
    row = wait_for_row(info.value.response.headers["x-request-id"])
    assert (row.status_code, row.error_code, row.upstream_attempts) == (404, "model_not_found", 0)
    assert row.adapter_tier == "" and row.queue_ms is None and row.inter_token_ms is None
    # A body that is not JSON, refused before the pipeline: its code too.
    response = httpx.post(f"{live.url}/v1/chat/completions", content=b"{not json",
                          headers={"authorization": f"Bearer {acme.key}", "content-type": "application/json"},
                          timeout=30)
    assert response.status_code == 400
    row = wait_for_row(response.headers["x-request-id"])
    assert row.error_code == (response.json()["error"]["code"] or response.json()["error"]["type"])
    assert row.error_code and row.upstream_attempts == 0

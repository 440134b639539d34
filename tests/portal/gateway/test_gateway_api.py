"""Chat and completions through the gateway with the official openai SDK, streaming and not:
the public model id everywhere, x-request-id, usage rows equal to the worker's own counts."""

from __future__ import annotations

import httpx
import pytest

from tests.portal.gateway.conftest import BASE, direct, make_caller, sdk, wait_for_row

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5, "temperature": 0}
PROMPT = {"model": BASE, "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}


def test_chat_non_streaming_matches_the_worker_and_is_billed_exactly(acme, worker, live):
    client = sdk(live, acme.key)
    raw = client.chat.completions.with_raw_response.create(**CHAT)
    completion = raw.parse()
    expected = direct(worker, "/v1/chat/completions", CHAT)
    assert completion.model == BASE
    assert completion.choices[0].message.content == expected["choices"][0]["message"]["content"]
    assert completion.usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert completion.usage.completion_tokens == expected["usage"]["completion_tokens"] == 5
    request_id = raw.headers["x-request-id"]
    assert request_id.startswith("req_")
    row = wait_for_row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (completion.usage.prompt_tokens, 5)
    assert row.tenant_id == acme.tenant.pk and row.api_key_id == acme.api_key.pk
    assert row.model == BASE and row.adapter_version_id is None and not row.stream
    assert row.status_code == 200 and row.finish_reason == "length" and not row.client_disconnected
    assert row.worker_url == worker.url and row.latency_ms > 0 and row.error == ""


def test_chat_streaming_with_usage_chunk(acme, worker, live):
    client = sdk(live, acme.key)
    stream = client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = direct(worker, "/v1/chat/completions", CHAT)
    assert text == expected["choices"][0]["message"]["content"]
    assert {c.model for c in chunks} == {BASE}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert chunks[-1].usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    row = wait_for_row(stream.response.headers["x-request-id"])
    assert row.stream and row.prompt_tokens == expected["usage"]["prompt_tokens"] and row.completion_tokens == 5
    assert row.time_to_first_token_ms is not None and 0 < row.time_to_first_token_ms <= row.latency_ms
    assert row.finish_reason == "length"


def test_streaming_without_usage_chunk_still_bills_the_workers_count(acme, worker, live):
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"authorization": f"Bearer {acme.key}", "x-request-id": "client-42"},
                      timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-client-request-id"] == "client-42"
        request_id = response.headers["x-request-id"]
        assert request_id != "client-42"
        lines = [line for line in response.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    assert all('"usage"' not in line for line in lines)
    expected = direct(worker, "/v1/chat/completions", CHAT)
    row = wait_for_row(request_id)
    assert (row.prompt_tokens, row.completion_tokens) == (expected["usage"]["prompt_tokens"], 5)


@pytest.mark.parametrize("stream", [False, True])
def test_completions(acme, worker, live, stream):
    client = sdk(live, acme.key)
    expected = direct(worker, "/v1/completions", PROMPT)
    if stream:
        chunks = list(client.completions.create(**PROMPT, stream=True, stream_options={"include_usage": True}))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert {c.model for c in chunks} == {BASE}
    else:
        completion = client.completions.create(**PROMPT)
        text, usage = completion.choices[0].text, completion.usage
        assert completion.model == BASE
    assert text == expected["choices"][0]["text"]
    assert usage.prompt_tokens == expected["usage"]["prompt_tokens"]
    assert usage.completion_tokens == expected["usage"]["completion_tokens"]


def test_models_lists_what_the_key_may_use(live):
    from portal.adapters.models import Adapter, AdapterVersion

    acme = make_caller("acme")
    other = make_caller("globex")
    bot = Adapter.objects.create(tenant=acme.tenant, name="bot")
    AdapterVersion.objects.create(adapter=bot, number=1, source_path="/nowhere")
    AdapterVersion.objects.create(adapter=bot, number=2, source_path="/nowhere")
    AdapterVersion.objects.create(adapter=bot, number=3, source_path="/nowhere",
                                  status=AdapterVersion.Status.REJECTED)
    draft = Adapter.objects.create(tenant=acme.tenant, name="draft")
    AdapterVersion.objects.create(adapter=draft, number=1, status=AdapterVersion.Status.VALIDATING)
    secret = Adapter.objects.create(tenant=other.tenant, name="secret")
    AdapterVersion.objects.create(adapter=secret, number=1, source_path="/nowhere")

    ids = [m.id for m in sdk(live, acme.key).models.list()]
    assert ids == [BASE, "acme/bot", "acme/bot@v1", "acme/bot@v2"]
    assert [m.id for m in sdk(live, other.key).models.list()] == [BASE, "globex/secret", "globex/secret@v1"]
    narrow = make_caller("acme", allowed_models=["acme/bot@v2"])
    assert [m.id for m in sdk(live, narrow.key).models.list()] == ["acme/bot@v2"]
    whole = make_caller("acme", allowed_models=["acme/bot", BASE])
    assert [m.id for m in sdk(live, whole.key).models.list()] == ids


def test_every_response_has_a_request_id(acme, live):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nope")]:
        response = httpx.request(method, f"{live.url}{path}", headers={"authorization": f"Bearer {acme.key}"},
                                 content=b"{", timeout=30)
        assert response.headers["x-request-id"].startswith("req_"), (path, response.status_code)
        assert "error" in response.json() or response.status_code == 200
    bad = httpx.get(f"{live.url}/v1/models", timeout=30)
    assert bad.status_code == 401 and bad.headers["x-request-id"].startswith("req_")


def test_routing_counts_a_request_in_flight_until_its_ledger_closes(live, worker):
    import threading

    from portal.fleet.inflight import inflight_snapshot

    caller = make_caller("acme")
    seen = []
    url = worker.url.rstrip("/")

    def stream():
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", timeout=120,
                          headers={"authorization": f"Bearer {caller.key}"},
                          json={"model": BASE, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 24,
                                "ignore_eos": True, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data:") and not seen:
                    seen.append(inflight_snapshot().get(url, 0))

    thread = threading.Thread(target=stream)
    thread.start()
    thread.join(120)

    assert seen == [1]  # counted while its tokens flowed
    assert inflight_snapshot().get(url, 0) == 0  # and no more once it ended

"""The gateway's short-lived caches (portal.gateway.cache) never outlive the write that changes
them: a key revoked, a tenant suspended, an adapter retired, deleted or re-weighted, a quota
lowered takes effect on the very next request after requests that filled the caches; a write
made by another process (the Redis generation moved, nothing signalled here) does too. Streams
relay the worker's own bytes, the model id swapped in place and the worker's report taken out."""

from __future__ import annotations

import itertools
import json
import re

import httpx
import openai
import pytest

from protocol.worker_api import REPORT_KEY
from tests.portal.gateway.conftest import (
    BASE,
    make_caller,
    model_path,
    sdk,
    wait_for_row,
    wait_until,
)
from tests.portal.gateway.lora_adapter import write_adapter
from tests.portal.gateway.metrics_scrape import scrape

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def warm(client, model: str = BASE, times: int = 2) -> None:
    """Requests that fill the caches (the second one is served from them)."""
    for _ in range(times):
        client.chat.completions.create(model=model, **CHAT)


def test_a_revoked_key_is_refused_on_the_next_request(live):
    from portal.keys.services import api_key_revoke

    caller = make_caller("acme")
    client = sdk(live, caller.key)
    warm(client)
    api_key_revoke(api_key=caller.api_key)
    with pytest.raises(openai.AuthenticationError) as info:
        client.chat.completions.create(model=BASE, **CHAT)
    assert info.value.body["code"] == "invalid_api_key"
    assert info.value.body["message"].startswith("This API key was revoked.")


def test_a_suspended_tenant_is_refused_on_the_next_request_and_served_again_once_active(live):
    from portal.tenants.services import tenant_activate, tenant_suspend

    caller = make_caller("acme")
    client = sdk(live, caller.key)
    warm(client)
    tenant_suspend(tenant=caller.tenant)
    with pytest.raises(openai.PermissionDeniedError) as info:
        client.chat.completions.create(model=BASE, **CHAT)
    assert info.value.body["code"] == "tenant_suspended"
    tenant_activate(tenant=caller.tenant)
    assert client.chat.completions.create(model=BASE, **CHAT).choices


def test_a_lowered_quota_binds_on_the_next_request(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    client = sdk(live, caller.key)
    warm(client)  # two requests in the tenant's window of this minute
    quota_set(tenant=caller.tenant, requests_per_minute=2)
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=BASE, **CHAT)
    assert info.value.body["code"] == "rate_limit_exceeded"


def test_a_write_in_another_process_reaches_this_one_through_the_redis_generation(live, settings):
    """Another web process revoked the key: its signal ran there, not here. The row changes
    without a signal in this process (a queryset update) and the generation moves in Redis."""
    import redis
    from django.utils import timezone

    from portal.gateway.cache import generation_key
    from portal.keys.models import ApiKey

    if not settings.REDIS_URL:
        pytest.skip("one process without Redis: there is no other process to hear from")
    caller = make_caller("acme")
    client = sdk(live, caller.key)
    warm(client)
    ApiKey.objects.filter(pk=caller.api_key.pk).update(revoked_at=timezone.now())
    assert client.chat.completions.create(model=BASE, **CHAT).choices  # nothing told this process yet
    redis.Redis.from_url(settings.REDIS_URL).incr(generation_key())
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=BASE, **CHAT)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache-adapters")
    return [write_adapter(root / name, model_path(), seed=seed) for name, seed in (("one", 3101), ("two", 3102))]


def test_retiring_reweighting_and_deleting_an_adapter_take_effect_on_the_next_request(live, adapter_dirs):
    from portal.adapters.deployments import deployment_set_weights
    from portal.adapters.models import Adapter, AdapterVersion
    from portal.adapters.services import adapter_delete, adapter_version_retire

    caller = make_caller("acme")
    adapter = Adapter.objects.create(tenant=caller.tenant, name="cached")
    one = AdapterVersion.objects.create(adapter=adapter, number=1, source_path=str(adapter_dirs[0]))
    AdapterVersion.objects.create(adapter=adapter, number=2, source_path=str(adapter_dirs[1]))
    client = sdk(live, caller.key)

    def served_version(model: str = "acme/cached") -> int:
        raw = client.chat.completions.with_raw_response.create(model=model, **CHAT)
        return wait_for_row(raw.headers["x-request-id"]).adapter_version.number

    assert [served_version(), served_version()] == [2, 2]  # no weights: the newest ready version
    deployment_set_weights(adapter=adapter, weights={1: 100}, actor=None)
    assert served_version() == 1
    assert served_version("acme/cached@v1") == 1
    adapter_version_retire(version=one, actor=None)
    assert served_version() == 2  # the weights lost version 1: the newest ready one serves
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="acme/cached@v1", **CHAT)
    adapter_delete(adapter=adapter, actor=None)
    for model in ("acme/cached", "acme/cached@v2"):
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model=model, **CHAT)
        assert info.value.body["code"] == "model_not_found"


def test_every_request_served_from_the_caches_is_on_the_ledger(live):
    from portal.usage.models import UsageRecord

    caller = make_caller("acme")
    client = sdk(live, caller.key)
    ids = []
    for stream in (False, True, False, True):
        raw = client.chat.completions.with_raw_response.create(model=BASE, stream=stream, **CHAT)
        if stream:
            list(raw.parse())
        ids.append(raw.headers["x-request-id"])
    rows = [wait_for_row(request_id) for request_id in ids]
    assert all(row.status_code == 200 and row.completion_tokens == 1 and row.api_key_id == caller.api_key.pk
               for row in rows)
    assert UsageRecord.objects.filter(api_key=caller.api_key).count() == 4


def test_the_overhead_is_measured_per_streamed_request(live):
    """loraplex_gateway_overhead_seconds counts each completion once, in each of its parts."""
    caller = make_caller("acme")
    parts = ("to_upstream", "relay", "total")

    def counts() -> dict[str, float]:
        sample = scrape(live.url)
        return {part: sample("loraplex_gateway_overhead_seconds_count", part=part) for part in parts}

    before = counts()
    list(sdk(live, caller.key).chat.completions.create(model=BASE, stream=True, **{**CHAT, "max_tokens": 3}))
    # observed once the handler is done with the request, just after the client's last byte
    after = wait_until(lambda: (now := counts())["total"] > before["total"] and now)
    assert {part: after[part] - before[part] for part in parts} == dict.fromkeys(parts, 1)
    assert scrape(live.url)("loraplex_gateway_overhead_seconds_sum", part="relay") > 0  # chunks were timed


def sse_data(url: str, body: dict, headers: dict) -> tuple[list[str], str | None]:
    """The `data:` texts of a stream as sent (before [DONE]), and its x-request-id."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
        request_id = response.headers.get("x-request-id")
    assert data[-1] == "[DONE]"
    return data[:-1], request_id


def same_request(text: str) -> str:
    """Two answers to the same greedy request differ in their id, creation time and how much of
    the prompt the worker's prefix cache held (the same prompt was sent before) only."""
    text = re.sub(r'"cached_tokens":\d+', '"cached_tokens":0', text)
    return re.sub(r'"created":\d+', '"created":0', re.sub(r'"id":"[^"]*"', '"id":""', text))


def test_streamed_chunks_are_the_workers_own_bytes_with_the_public_model_id(live, worker, adapter_dirs):
    """What the worker streams reaches the client byte for byte, but for the model id (the
    public one) and the worker's report, which only the ledger gets."""
    from portal.adapters.models import Adapter, AdapterVersion

    caller = make_caller("acme")
    adapter = Adapter.objects.create(tenant=caller.tenant, name="bytes")
    version = AdapterVersion.objects.create(adapter=adapter, number=1, source_path=str(adapter_dirs[0]))
    headers = {"authorization": f"Bearer {caller.key}"}
    body = {"messages": [{"role": "user", "content": "Count to five."}], "max_tokens": 6, "temperature": 0,
            "stream": True}
    for (public_id, worker_model), usage in itertools.product(
            ((BASE, BASE), ("acme/bytes", version.worker_name)), (True, False)):
        # The gateway always asks the worker for the usage chunk; a client that did not ask gets
        # what the worker sends such a client (no usage fields at all).
        options = {"stream_options": {"include_usage": True}} if usage else {}
        relayed, request_id = sse_data(live.url, {**body, **options, "model": public_id}, headers)  # loads it
        sent, _ = sse_data(worker.url, {**body, **options, "model": worker_model}, {})
        expected = []
        for text in sent:
            chunk = json.loads(text)
            if REPORT_KEY in chunk:  # the worker's extension: out of the client's chunk, re-encoded
                del chunk[REPORT_KEY]
                text = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
            expected.append(text.replace(f'"model":"{worker_model}"', f'"model":"{public_id}"'))
        assert [same_request(text) for text in relayed] == [same_request(text) for text in expected]
        assert all(REPORT_KEY not in text for text in relayed)
        row = wait_for_row(request_id)
        assert row.model == public_id and row.completion_tokens == 6 and row.status_code == 200
        assert row.queue_ms is not None  # the report reached the ledger

"""PostgreSQL or Redis unreachable, against the web process as deployed: every /v1 answer is a
JSON 503 with Retry-After (never Django's HTML 500), and a request whose ledger row could not be
written because the database went away mid-stream is spooled and written back once it returns."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import redis

from tests.portal.gateway.conftest import BASE, make_caller, wait_until
from tests.tcp_proxy import TcpProxy

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def assert_json_503(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert response.json()["error"]["code"] == "service_unavailable"
    assert int(response.headers["retry-after"]) >= 1
    assert response.headers["x-request-id"].startswith("req_")


def test_postgres_unreachable_is_a_json_503(start_production_web):
    caller = make_caller("acme")
    web = start_production_web(DATABASE_URL="postgres://postgres@127.0.0.1:1/loraplex", DATABASE_POOL_TIMEOUT="1",
                               healthy=False)
    headers = {"authorization": f"Bearer {caller.key}"}

    assert_json_503(httpx.post(f"{web.url}/v1/chat/completions", json=CHAT, headers=headers, timeout=30))
    assert_json_503(httpx.get(f"{web.url}/v1/models", headers=headers, timeout=30))
    assert httpx.get(f"{web.url}/healthz", timeout=30).status_code == 503


def test_redis_unreachable_is_a_json_503_and_on_the_ledger(start_production_web):
    from portal.usage.models import UsageRecord

    caller = make_caller("acme")
    web = start_production_web(REDIS_URL="redis://127.0.0.1:1/0", healthy=False)

    response = httpx.post(f"{web.url}/v1/chat/completions", json=CHAT, timeout=30,
                          headers={"authorization": f"Bearer {caller.key}"})

    assert_json_503(response)
    row = UsageRecord.objects.get(request_id=response.headers["x-request-id"])
    assert row.status_code == 503 and row.tenant_id == caller.tenant.pk
    assert row.prompt_tokens == row.completion_tokens == 0


def test_a_stream_outlives_the_database_and_its_row_is_replayed(start_production_web, settings):
    from portal.usage.models import UsageRecord
    from portal.usage.spool import usage_spool_replay

    database = settings.DATABASES["default"]
    prefix = f"test:outage:{uuid.uuid4().hex}:"
    caller = make_caller("acme")
    with TcpProxy("127.0.0.5", upstream=(database["HOST"] or "127.0.0.1", int(database["PORT"] or 5432))) as proxy:
        url = f"postgres://{database['USER']}@{proxy.host}:{proxy.port}/{database['NAME']}"
        web = start_production_web(DATABASE_URL=url, DATABASE_POOL_TIMEOUT="1", REDIS_KEY_PREFIX=prefix)
        body = {**CHAT, "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{web.url}/v1/chat/completions", json=body, timeout=120,
                          headers={"authorization": f"Bearer {caller.key}"}) as response:
            request_id = response.headers["x-request-id"]
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            proxy.cut()  # PostgreSQL gone for the web process, mid-stream
            rest = [line for line in lines if line.startswith("data:")]
        chunks = [json.loads(line[5:]) for line in [first, *rest[:-1]]]
        assert rest[-1] == "data: [DONE]" and not any("error" in chunk for chunk in chunks)
        received = sum(1 for chunk in chunks for choice in chunk["choices"] if choice["delta"].get("content"))

        client = redis.Redis.from_url(settings.REDIS_URL)
        spool_key = f"{prefix}usage:spool"
        spooled = wait_until(lambda: client.lrange(spool_key, 0, -1), timeout=60)
        assert [json.loads(line)["request_id"] for line in spooled] == [request_id]
        assert not UsageRecord.objects.filter(request_id=request_id).exists()

        proxy.restore()
        settings.USAGE_SPOOL_KEY = spool_key
        assert usage_spool_replay() == {"written": 1, "dead": 0, "left": 0}
        row = UsageRecord.objects.get(request_id=request_id)
        assert row.status_code == 200 and row.stream and row.completion_tokens == 48 >= received > 0
        assert client.llen(spool_key) == 0
        client.close()

        # The web process's pool recovers by itself once PostgreSQL is back.
        deadline = time.monotonic() + 30
        while True:
            again = httpx.post(f"{web.url}/v1/chat/completions", json=CHAT, timeout=60,
                               headers={"authorization": f"Bearer {caller.key}"})
            if again.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert again.status_code == 200, again.text

"""Keys and OpenAI conventions at the gateway: a rotated-out secret works for its grace period
only; an expired key is told so; a REST-made allow-list holds; money limits answer 429
insufficient_quota; /v1/models carries real `created` times; a 503 names no internal address."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from decimal import ROUND_CEILING, Decimal

import httpx
import openai
import pytest
from django.utils import timezone

from tests.portal.gateway.conftest import (
    BASE,
    free_port,
    make_caller,
    sdk,
    wait_for_row,
    wait_until,
)

CHAT = {"model": BASE, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def models(live, key: str) -> httpx.Response:
    return httpx.get(f"{live.url}/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=60)


def test_a_rotated_out_secret_works_until_its_grace_ends(live):
    from portal.keys.services import api_key_end_grace, api_key_rotate

    caller = make_caller("acme")
    api_key, new = api_key_rotate(api_key=caller.api_key, grace=timedelta(hours=1))
    assert models(live, caller.key).status_code == models(live, new).status_code == 200

    api_key_end_grace(api_key=api_key, at=timezone.now() - timedelta(seconds=1))

    refused = models(live, caller.key)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert "rotated" in refused.json()["error"]["message"]
    assert sdk(live, new).chat.completions.create(**CHAT).choices


def test_an_expired_key_is_401_and_says_it_expired(live):
    from portal.keys.models import ApiKey

    caller = make_caller("acme", expires_at=timezone.now() + timedelta(seconds=60))
    ApiKey.objects.filter(pk=caller.api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))

    with pytest.raises(openai.AuthenticationError) as info:
        sdk(live, caller.key).chat.completions.create(**CHAT)

    assert info.value.body["code"] == "invalid_api_key" and "expired" in info.value.body["message"]


def test_a_key_made_over_rest_keeps_to_its_allow_list(live, django_user_model):
    from rest_framework.test import APIClient

    from portal.tenants.services import membership_create

    caller = make_caller("acme")
    owner = django_user_model.objects.create_user(username="olga", password="x")
    membership_create(tenant=caller.tenant, user=owner, role="owner")
    rest = APIClient()
    rest.force_login(owner)
    made = rest.post("/api/v1/tenants/acme/keys/", {"name": "bot only", "allowed_models": ["acme/bot"]}, format="json")
    assert made.status_code == 201, made.json()
    narrow = made.json()["key"]

    with pytest.raises(openai.NotFoundError) as info:
        sdk(live, narrow).chat.completions.create(**CHAT)  # the base exists, but not for this key

    assert info.value.status_code == 404 and info.value.body["code"] == "model_not_found"
    assert models(live, narrow).json()["data"] == []
    assert [m["id"] for m in models(live, caller.key).json()["data"]] == [BASE]


def test_a_spent_money_limit_is_429_insufficient_quota(live):
    from portal.quotas.services import quota_set, quota_usage
    from portal.tenants.plans import plan_for
    from portal.usage.billing import token_cost

    caller = make_caller("acme")  # the enterprise plan: no token budget, priced per 1M tokens
    quota_set(api_key=caller.api_key, monthly_spend_limit="1.00")
    first = sdk(live, caller.key).chat.completions.with_raw_response.create(**CHAT)
    row = wait_for_row(first.headers["x-request-id"])
    plan = plan_for("enterprise")
    cost = token_cost(row.prompt_tokens, plan.prompt_price_per_million) + token_cost(
        row.completion_tokens, plan.completion_price_per_million)

    spent = wait_until(lambda: quota_usage(tenant=caller.tenant, api_key=caller.api_key)["monthly_spend_limit"]["used"])
    assert spent == cost > 0  # the statement's price, exactly

    # A limit just above what is spent: less than any request's estimate is left.
    quota_set(api_key=caller.api_key, monthly_spend_limit=spent.quantize(Decimal("0.000001"), ROUND_CEILING))
    retrying = openai.OpenAI(base_url=f"{live.url}/v1", api_key=caller.key, max_retries=3, timeout=60)
    with pytest.raises(openai.RateLimitError) as info:
        retrying.chat.completions.create(**CHAT)

    assert info.value.body == {"message": info.value.body["message"], "type": "insufficient_quota", "param": None,
                               "code": "insufficient_quota"}
    assert "spend limit" in info.value.body["message"] and "USD" in info.value.body["message"]
    assert info.value.response.headers["x-should-retry"] == "false"
    from portal.usage.models import UsageRecord

    assert UsageRecord.objects.filter(tenant=caller.tenant, status_code=429).count() == 1  # not retried


def test_a_tenants_zero_spend_limit_refuses_every_key(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    quota_set(tenant=caller.tenant, monthly_spend_limit=0)

    response = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT,
                          headers={"authorization": f"Bearer {caller.key}"}, timeout=60)

    assert response.status_code == 429
    assert response.json()["error"]["type"] == response.json()["error"]["code"] == "insufficient_quota"


def test_a_rate_limit_keeps_rate_limit_exceeded(live):
    from portal.quotas.services import quota_set

    caller = make_caller("acme")
    quota_set(tenant=caller.tenant, requests_per_minute=0)

    response = httpx.post(f"{live.url}/v1/chat/completions", json=CHAT,
                          headers={"authorization": f"Bearer {caller.key}"}, timeout=60)

    assert response.status_code == 429 and response.json()["error"]["code"] == "rate_limit_exceeded"
    assert response.json()["error"]["type"] == "requests"


def test_models_carry_real_created_times(live, worker):
    from portal.adapters.models import Adapter, AdapterVersion
    from portal.fleet.models import InferenceWorker

    caller = make_caller("acme")
    adapter = Adapter.objects.create(tenant=caller.tenant, name="bot")
    version = AdapterVersion.objects.create(adapter=adapter, number=1, source_path="/nowhere",
                                            status=AdapterVersion.Status.READY)
    before = {m["id"]: m["created"] for m in models(live, caller.key).json()["data"]}
    assert 0 < before[BASE] <= timezone.now().timestamp()  # when this gateway first learnt the base
    assert before["acme/bot@v1"] == int(version.created_at.timestamp())

    # Once the fleet knows a worker serving it: when that worker first appeared.
    first_seen = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    row = InferenceWorker.objects.create(url=worker.url, base_model=BASE, enabled=True, healthy=False)
    InferenceWorker.objects.filter(pk=row.pk).update(created_at=first_seen)

    after = {m["id"]: m["created"] for m in models(live, caller.key).json()["data"]}
    assert after[BASE] == int(first_seen.timestamp())
    assert models(live, caller.key).json()["data"][0]["created"] == after[BASE]  # stable


@pytest.mark.parametrize("stream", [False, True])
def test_a_503_with_every_worker_down_names_no_address(live, settings, monkeypatch, stream):
    from portal.gateway import resolve

    caller = make_caller("acme")
    assert models(live, caller.key).status_code == 200  # the gateway learns the base name meanwhile
    dead = [f"http://127.0.0.1:{free_port()}", f"http://localhost:{free_port()}"]
    settings.INFERENCE_URLS = dead
    # However long ago it learnt the base's name, an outage is a 503, not "no such model".
    monkeypatch.setattr(resolve, "BASE_NAME_TTL", 0.0)

    response = httpx.post(f"{live.url}/v1/chat/completions", json={**CHAT, "stream": stream},
                          headers={"authorization": f"Bearer {caller.key}"}, timeout=120)

    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "no_worker_available"
    text = response.text
    ports = [url.rsplit(":", 1)[1] for url in dead]
    assert "http" not in text and "127.0.0.1" not in text and "localhost" not in text
    assert not any(port in text for port in ports), text
    assert not re.search(r"\d+\.\d+\.\d+\.\d+", text)
    row = wait_for_row(response.headers["x-request-id"])
    assert not any(port in row.error for port in ports) and "127.0.0.1" not in row.error

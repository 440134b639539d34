"""Keys, tenants and models: another tenant's adapter is indistinguishable from a missing
model; revoked and expired keys are 401, a suspended tenant 403; the allow-list holds."""

from __future__ import annotations

import httpx
import openai
import pytest
from django.utils import timezone

from tests.portal.gateway.conftest import BASE, make_caller, sdk, wait_for_row

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def not_found_message(model: str) -> str:
    return f"The model `{model}` does not exist or you do not have access to it."


def test_another_tenants_adapter_is_404_like_a_missing_one(live):
    from portal.adapters.models import Adapter, AdapterVersion

    acme = make_caller("acme")
    globex = make_caller("globex")
    secret = Adapter.objects.create(tenant=globex.tenant, name="secret")
    AdapterVersion.objects.create(adapter=secret, number=1, source_path="/nowhere")
    client = sdk(live, acme.key)
    for model in ["globex/secret", "globex/secret@v1", "globex/missing", "acme/missing", "acme/secret",
                  "no-such-base", "acme/bot@v0"]:
        with pytest.raises(openai.NotFoundError) as info:
            client.chat.completions.create(model=model, **CHAT)
        assert info.value.body == {"message": not_found_message(model), "type": "invalid_request_error",
                                   "param": "model", "code": "model_not_found"}


def test_revoked_and_expired_keys_are_401(live):
    from portal.keys.models import ApiKey
    from portal.keys.services import api_key_revoke

    revoked = make_caller("acme")
    api_key_revoke(api_key=revoked.api_key)
    expired = make_caller("acme", expires_at=timezone.now() + timezone.timedelta(seconds=60))
    ApiKey.objects.filter(pk=expired.api_key.pk).update(expires_at=timezone.now() - timezone.timedelta(seconds=1))
    for key in [revoked.key, expired.key, "sk-not-a-real-key", "nonsense"]:
        with pytest.raises(openai.AuthenticationError) as info:
            sdk(live, key).chat.completions.create(model=BASE, **CHAT)
        assert info.value.body["code"] == "invalid_api_key"
    for headers in [{}, {"authorization": "Basic abc"}, {"authorization": "Bearer"}, {"authorization": "Bearer sk-"}]:
        response = httpx.get(f"{live.url}/v1/models", headers=headers, timeout=30)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_suspended_tenant_is_403(live):
    caller = make_caller("acme")
    caller.tenant.status = "suspended"
    caller.tenant.save(update_fields=["status"])
    with pytest.raises(openai.PermissionDeniedError) as info:
        sdk(live, caller.key).chat.completions.create(model=BASE, **CHAT)
    assert info.value.body["code"] == "tenant_suspended"
    with pytest.raises(openai.PermissionDeniedError):
        sdk(live, caller.key).models.list()


def test_the_allow_list_limits_the_models(live):
    from portal.usage.models import UsageRecord

    caller = make_caller("acme", allowed_models=["acme/bot"])
    with pytest.raises(openai.NotFoundError) as info:
        sdk(live, caller.key).chat.completions.create(model=BASE, **CHAT)
    assert info.value.body["message"] == not_found_message(BASE)
    row = UsageRecord.objects.get(request_id=info.value.response.headers["x-request-id"])
    assert row.status_code == 404 and row.prompt_tokens == row.completion_tokens == 0


def test_tenants_never_hit_each_others_prefix_cache_and_cannot_pick_a_salt(live):
    acme, globex = make_caller("acme"), make_caller("globex")
    long_chat = {"messages": [{"role": "user", "content": "Repeat after me: " + "one two three four " * 30}],
                 "max_tokens": 1, "temperature": 0}

    def cached_tokens(caller) -> int:
        raw = sdk(live, caller.key).chat.completions.with_raw_response.create(model=BASE, **long_chat)
        usage = raw.parse().usage
        # The ledger keeps what the client was told: the basis of a cached-token rate.
        row = wait_for_row(raw.headers["x-request-id"])
        assert (row.prompt_tokens, row.cached_prompt_tokens) == (usage.prompt_tokens,
                                                                 usage.prompt_tokens_details.cached_tokens)
        return usage.prompt_tokens_details.cached_tokens

    first = cached_tokens(acme)
    assert cached_tokens(acme) > first  # the same tenant's repeat is served from the cache
    assert cached_tokens(globex) == 0  # the same prompt from another tenant is computed afresh
    for endpoint, body in (("chat/completions", {**CHAT, "model": BASE}),
                           ("completions", {"prompt": "Hi", "max_tokens": 2, "model": BASE})):
        response = httpx.post(f"{live.url}/v1/{endpoint}", json={**body, "cache_salt": "acme"},
                              headers={"Authorization": f"Bearer {globex.key}"}, timeout=60)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "cache_salt"

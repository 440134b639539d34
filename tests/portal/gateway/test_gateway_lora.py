"""A tenant's adapter through the gateway: `tenant/name` and `@vN` resolve to the version's
worker name, the worker loads it lazily on the first request, the answer differs from the
base; an adapter the worker rejects is a clear 400 that never names the internal id."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.portal.gateway.conftest import ADMIN_TOKEN, BASE, model_path, sdk, wait_for_row
from tests.portal.gateway.lora_adapter import write_adapter

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    return write_adapter(tmp_path_factory.mktemp("lora") / "bot", model_path(), seed=7)


def worker_adapters(worker) -> dict:
    response = httpx.get(f"{worker.url}/v1/adapters", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    return {a["name"]: a for a in response.json()["data"]}


def test_adapter_loads_lazily_and_changes_the_answer(acme, worker, live, adapter_dir):
    from portal.adapters.models import Adapter, AdapterVersion

    bot = Adapter.objects.create(tenant=acme.tenant, name="bot")
    version = AdapterVersion.objects.create(adapter=bot, number=1, source_path=str(adapter_dir))
    assert version.worker_name not in worker_adapters(worker)

    client = sdk(live, acme.key)
    base = client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=5, temperature=0)
    raw = client.chat.completions.with_raw_response.create(model="acme/bot", messages=MESSAGES, max_tokens=5,
                                                           temperature=0)
    tuned = raw.parse()
    assert tuned.model == "acme/bot"
    assert tuned.choices[0].message.content != base.choices[0].message.content
    assert version.worker_name in worker_adapters(worker)  # loaded on the first request
    row = wait_for_row(raw.headers["x-request-id"])
    assert row.adapter_version_id == version.pk and row.model == "acme/bot"
    assert row.completion_tokens == tuned.usage.completion_tokens

    # the pinned version, streamed: the same greedy answer, the public id in every chunk
    chunks = list(client.chat.completions.create(model="acme/bot@v1", messages=MESSAGES, max_tokens=5,
                                                 temperature=0, stream=True))
    assert {c.model for c in chunks} == {"acme/bot@v1"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tuned.choices[0].message.content
    assert "lora-" not in str([c.model_dump() for c in chunks])


def test_an_adapter_the_worker_rejects_is_a_400_without_internal_names(acme, live, tmp_path):
    from portal.adapters.models import Adapter, AdapterVersion

    broken = Adapter.objects.create(tenant=acme.tenant, name="broken")
    version = AdapterVersion.objects.create(adapter=broken, number=1, source_path=str(tmp_path / "missing"))
    with pytest.raises(openai.BadRequestError) as info:
        sdk(live, acme.key).chat.completions.create(model="acme/broken", messages=MESSAGES, max_tokens=2)
    error = info.value.body
    assert error["code"] == "adapter_load_failed" and error["param"] == "model"
    assert "acme/broken" in error["message"] and version.worker_name not in error["message"]


def test_deployment_weights_choose_the_version_and_rollback_takes_effect_at_once(acme, worker, live, adapter_dir):
    from portal.adapters.deployments import deployment_set_weights
    from portal.adapters.models import Adapter, AdapterVersion

    canary = Adapter.objects.create(tenant=acme.tenant, name="canary")
    v1 = AdapterVersion.objects.create(adapter=canary, number=1, source_path=str(adapter_dir))
    v2 = AdapterVersion.objects.create(adapter=canary, number=2, source_path=str(adapter_dir))
    client = sdk(live, acme.key)

    def served_version() -> int:
        raw = client.chat.completions.with_raw_response.create(model="acme/canary", messages=MESSAGES,
                                                               max_tokens=1, temperature=0)
        return wait_for_row(raw.headers["x-request-id"]).adapter_version_id

    deployment_set_weights(adapter=canary, weights={1: 0, 2: 100}, actor=None)
    assert served_version() == v2.pk
    deployment_set_weights(adapter=canary, weights={1: 100, 2: 0}, actor=None)  # rollback
    assert served_version() == v1.pk

"""Against the live gateway and a real SmolLM2 worker (tests/portal/gateway/conftest.py):
feedback on a completion by its id through POST /v1/feedback (OpenAI-shaped errors), and the
canary guard rolling back a canary the worker refuses — its stored adapter_model.safetensors was
corrupted after it became ready, a real fault: every request for it fails — while a healthy
canary keeps its traffic."""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest

from tests.portal.gateway.conftest import make_caller, model_path, sdk, wait_for_row, wait_until
from tests.portal.gateway.lora_adapter import write_adapter

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout-lora")
    return write_adapter(root / "v1", model_path(), seed=3), write_adapter(root / "v2", model_path(), seed=4)


def two_versions(tenant, adapter_dirs, tmp_path, *, corrupt_v2: bool):
    from portal.adapters.models import Adapter, AdapterVersion

    adapter = Adapter.objects.create(tenant=tenant, name="bot")
    v1_dir, v2_dir = adapter_dirs
    if corrupt_v2:  # a copy, corrupted after the version is ready: the worker refuses to load it
        v2_dir = shutil.copytree(v2_dir, tmp_path / "v2-corrupt")
    versions = [AdapterVersion.objects.create(adapter=adapter, number=n, source_path=str(path),
                                              status=AdapterVersion.Status.READY)
                for n, path in ((1, v1_dir), (2, v2_dir))]
    if corrupt_v2:
        (v2_dir / "adapter_model.safetensors").write_bytes(b"\x00garbage, not a safetensors header" * 8)
    return adapter, versions


def feedback(live, key: str, body) -> httpx.Response:
    return httpx.post(f"{live.url}/v1/feedback", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def test_feedback_by_completion_id_through_v1(acme, live, adapter_dirs, tmp_path):
    from portal.rollouts.models import Feedback

    bot, (v1, _) = two_versions(acme.tenant, adapter_dirs, tmp_path, corrupt_v2=False)
    client = sdk(live, acme.key)
    raw = client.chat.completions.with_raw_response.create(model="acme/bot@v1", messages=MESSAGES, max_tokens=2,
                                                           temperature=0)
    answer = raw.parse()
    assert wait_for_row(raw.headers["x-request-id"]).completion_id == answer.id
    ok = feedback(live, acme.key, {"id": answer.id, "rating": "down", "comment": "not a colour"})
    assert ok.status_code == 200 and ok.json()["rating"] == "down"
    assert feedback(live, acme.key, {"id": answer.id, "rating": "up"}).json()["rating"] == "up"  # replaces it
    stored = Feedback.objects.get()
    assert (stored.rating, stored.comment, stored.adapter_version_id, stored.source) == ("up", "", v1.pk, "api")

    # a stream: the id of its chunks
    chunks = list(client.chat.completions.create(model="acme/bot@v1", messages=MESSAGES, max_tokens=2, stream=True))
    stream_id = chunks[0].id
    wait_until(lambda: acme.tenant.usage_records.filter(completion_id=stream_id).exists())
    assert feedback(live, acme.key, {"id": stream_id, "rating": "up"}).status_code == 200

    # bad input: OpenAI-shaped errors, nothing stored
    other = make_caller("globex")
    for key, body, status, param in ((acme.key, {"id": answer.id, "rating": "meh"}, 400, "rating"),
                                     (acme.key, {"rating": "up"}, 400, "id"),
                                     (acme.key, {"id": answer.id, "rating": "up", "comment": 5}, 400, "comment"),
                                     (acme.key, {"id": "chatcmpl-nope", "rating": "up"}, 404, "id"),
                                     (other.key, {"id": answer.id, "rating": "down"}, 404, "id")):
        response = feedback(live, key, body)
        assert response.status_code == status, response.text
        assert response.json()["error"]["param"] == param and response.json()["error"]["message"]
    assert httpx.post(f"{live.url}/v1/feedback", content=b"{not json", timeout=30,
                      headers={"authorization": f"Bearer {acme.key}"}).status_code == 400
    assert httpx.post(f"{live.url}/v1/feedback", json={"id": answer.id, "rating": "up"}, timeout=30).status_code == 401
    assert httpx.get(f"{live.url}/v1/feedback", headers={"authorization": f"Bearer {acme.key}"},
                     timeout=30).status_code == 405
    assert Feedback.objects.count() == 2


def drive(live, key: str, version, *, at_least: int, limit: int = 80) -> None:
    """Requests to acme/bot (the deployment's split) until `version` has served `at_least`."""
    from portal.usage.models import UsageRecord

    client = sdk(live, key)
    for _ in range(limit):
        try:
            raw = client.chat.completions.with_raw_response.create(model="acme/bot", messages=MESSAGES, max_tokens=1,
                                                                   temperature=0)
            wait_for_row(raw.headers["x-request-id"])
        except openai.BadRequestError as error:  # the corrupt canary's answers
            wait_for_row(error.response.headers["x-request-id"])
        if UsageRecord.objects.filter(adapter_version=version).count() >= at_least:
            return
    raise AssertionError(f"{version} served fewer than {at_least} of {limit} requests")


def test_the_guard_rolls_back_a_canary_the_worker_refuses(acme, live, adapter_dirs, tmp_path):
    from portal.adapters.deployments import deployment_get, deployment_set_weights
    from portal.adapters.models import AuditEvent
    from portal.rollouts.selectors import rollback_banner
    from portal.rollouts.services import canary_guard_update
    from portal.rollouts.tasks import canary_guard_check_task
    from portal.usage.models import UsageRecord

    bot, (v1, v2) = two_versions(acme.tenant, adapter_dirs, tmp_path, corrupt_v2=True)
    deployment_set_weights(adapter=bot, weights={1: 60, 2: 40}, actor=None)
    canary_guard_update(deployment=deployment_get(adapter=bot), actor=None, min_requests=6)
    drive(live, acme.key, v2, at_least=6)
    failed = UsageRecord.objects.filter(adapter_version=v2)
    assert {(r.status_code, r.error_code) for r in failed} == {(400, "adapter_load_failed")}

    assert canary_guard_check_task() == 1
    assert deployment_get(adapter=bot).weights == {"1": 60, "2": 0}
    event = AuditEvent.objects.get(action="deployment.canary_rolled_back", target="acme/bot@v2")
    assert event.details["canary"]["error_rate"] == 1.0 and event.details["stable"]["errors"] == 0
    assert rollback_banner(adapter=bot)["version"] == 2
    # from now on every request is served by v1, and answered
    client = sdk(live, acme.key)
    for _ in range(3):
        raw = client.chat.completions.with_raw_response.create(model="acme/bot", messages=MESSAGES, max_tokens=1)
        assert wait_for_row(raw.headers["x-request-id"]).adapter_version_id == v1.pk


def test_the_guard_leaves_a_healthy_canary_alone(acme, live, adapter_dirs, tmp_path):
    from portal.adapters.deployments import deployment_get, deployment_set_weights
    from portal.adapters.models import AuditEvent
    from portal.rollouts.services import canary_guard_update
    from portal.rollouts.tasks import canary_guard_check_task
    from portal.usage.models import UsageRecord

    bot, (v1, v2) = two_versions(acme.tenant, adapter_dirs, tmp_path, corrupt_v2=False)
    deployment_set_weights(adapter=bot, weights={1: 60, 2: 40}, actor=None)
    # TTFT on a shared CPU varies: this canary is judged on errors, the factor kept wide
    canary_guard_update(deployment=deployment_get(adapter=bot), actor=None, min_requests=6, ttft_p95_factor=50.0)
    drive(live, acme.key, v2, at_least=6)
    assert not UsageRecord.objects.filter(adapter_version=v2, status_code__gte=400).exists()
    assert canary_guard_check_task() == 0
    assert deployment_get(adapter=bot).weights == {"1": 60, "2": 40}
    assert not AuditEvent.objects.filter(action="deployment.canary_rolled_back").exists()

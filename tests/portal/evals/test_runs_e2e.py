"""End to end, all real: a tiny inference worker (polled into the fleet), the live portal serving
adapter files to it, two uploaded versions that answer differently (v1's B matrices are zero, so it
answers exactly as the base; v2 has a strong delta). Uploading v2 with an evaluation set in place
runs every case on v2 and on v1 (serving) through the worker; results, pass rates and the changed
verdicts are stored; the gate then refuses v2 traffic and lets a passing one through. A run whose
worker dies midway is failed with the reason, never a pass, and runs again by hand."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import connection

from portal.adapters.deployments import deployment_set_evaluation_gate, deployment_set_weights
from portal.adapters.models import AdapterVersion, Deployment
from portal.adapters.services import adapter_create, adapter_version_upload
from portal.core.exceptions import InvalidInput
from portal.evals import selectors
from portal.evals.models import EvaluationResult, EvaluationRun
from portal.evals.services import (
    evaluation_run_again,
    evaluation_run_execute,
    evaluation_set_upload,
)
from portal.fleet.models import InferenceWorker
from portal.fleet.services import worker_poll
from protocol.adapter_format import BaseShapes
from tests.portal.adapters.peft_files import peft_config, write_peft

TOKEN = "evals-e2e-fleet-secret"
TARGETS = ("q_proj", "v_proj", "down_proj")
PROMPT = "t5 t17 t42 t99 t3 t250"

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def worker(tmp_path_factory, live_server):
    """The tiny worker, fetching adapters only from the live portal's origin."""
    from tests.inference.server.server_process import start_server
    from tests.inference.server.tiny_lora import write_base

    root = tmp_path_factory.mktemp("evals")
    base = write_base(root / "base")
    proc = start_server(
        ["--model", str(base), "--served-model-name", "tiny-base", "--dtype", "float32", "--kv-cache-memory", "4MiB",
         "--max-num-seqs", "8", "--max-lora-rank", "16"],
        root / "worker.log",
        env={"INFERENCE_ADMIN_TOKEN": TOKEN, "INFERENCE_ADAPTER_CACHE_DIR": str(root / "cache"),
             "INFERENCE_PORTAL_ORIGINS": live_server.url},
    )
    holder = {"proc": proc}
    yield holder
    holder["proc"].stop()


@pytest.fixture
def fleet(worker, live_server, settings):
    settings.INFERENCE_ADMIN_TOKEN = TOKEN
    settings.PORTAL_INTERNAL_URL = live_server.url
    settings.INFERENCE_URLS = []
    row = worker_poll(worker=InferenceWorker.objects.create(url=worker["proc"].url, name="tiny"))
    assert row.healthy, row.last_error
    return row


def _dirs(tmp_path, base_config: dict):
    shapes = BaseShapes.from_config(base_config)
    config = peft_config(r=8, lora_alpha=16, target_modules=list(TARGETS), base_model_name_or_path=shapes.name)

    def zero_b(tensors):  # an adapter that changes nothing: answers as the base does
        for key in tensors:
            if "lora_B" in key:
                tensors[key][:] = 0

    def strong(tensors):
        for key in tensors:
            if "lora_B" in key:
                tensors[key] *= 40

    same = write_peft(tmp_path / "same", shapes, rank=8, targets=TARGETS, seed=1, config=config, edit=zero_b)
    different = write_peft(tmp_path / "different", shapes, rank=8, targets=TARGETS, seed=3, config=config, edit=strong)
    return same, different


def _upload(adapter, directory, actor):
    files = [SimpleUploadedFile(p.name, p.read_bytes()) for p in sorted(directory.iterdir())]
    version = adapter_version_upload(adapter=adapter, files=files, actor=actor)
    version.refresh_from_db()
    assert version.status == AdapterVersion.Status.READY, version.rejection_reasons
    return version


def _base_answer(url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": "tiny-base", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _jsonl(cases: list[dict]) -> bytes:
    return "\n".join(json.dumps(c) for c in cases).encode()


def test_new_version_is_evaluated_against_the_serving_one_and_gated(fleet, worker, tenant, member, tmp_path, api):
    same, different = _dirs(tmp_path, fleet.base_config)
    adapter = adapter_create(tenant=tenant, name="pirate", actor=member)
    v1 = _upload(adapter, same, member)
    assert not EvaluationRun.objects.exists()  # no set yet: nothing to run

    expected = _base_answer(worker["proc"].url, PROMPT, 6)
    evaluation_set_upload(adapter=adapter, actor=member, filename="cases.jsonl", data=_jsonl([
        {"name": "answers like the base", "prompt": PROMPT, "expected": expected, "check": "exact", "max_tokens": 6},
        {"name": "json", "prompt": "t1 t2 t3", "check": "json_valid", "max_tokens": 4},
        {"name": "recorded only", "prompt": "t8 t9", "max_tokens": 3},
    ]))
    deployment_set_evaluation_gate(adapter=adapter, require=True, min_pass_rate=None, actor=member)

    v2 = _upload(adapter, different, member)  # ready -> held off traffic -> evaluated (eager Celery)
    assert Deployment.objects.get(adapter=adapter).weights == {"1": 100}  # v1 keeps serving meanwhile
    run = EvaluationRun.objects.get(candidate=v2)
    assert run.status == EvaluationRun.Status.COMPLETED, run.error
    assert run.baseline == v1 and run.trigger == EvaluationRun.Trigger.VERSION_READY
    assert (run.candidate_passed, run.baseline_passed, run.checked_count) == (0, 1, 2)
    assert run.candidate_rate == 0.0 and run.baseline_rate == 0.5

    results = {(r.version.number, r.case_name): r for r in EvaluationResult.objects.filter(run=run)}
    assert len(results) == 6 and all(r.latency_ms > 0 for r in results.values())
    assert results[(1, "answers like the base")].output == expected
    assert results[(1, "answers like the base")].verdict == "pass"
    assert results[(2, "answers like the base")].verdict == "fail"
    assert results[(2, "answers like the base")].output != expected
    assert "expected exactly" in results[(2, "answers like the base")].detail
    assert results[(2, "recorded only")].verdict == "unchecked" and results[(2, "recorded only")].output
    assert results[(1, "json")].verdict == results[(2, "json")].verdict == "fail"

    changed = [row for row in selectors.evaluation_run_rows(run=run) if row.changed]
    assert [row.name for row in changed] == ["answers like the base"]
    assert changed[0].candidate.output != changed[0].baseline.output == expected

    # the version page shows both pass rates and the changed case with both outputs
    page = api.get(f"/t/{tenant.slug}/adapters/pirate/versions/2/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "0/2 (0%)" in html and "1/2 (50%)" in html and "answers like the base" in html
    assert results[(2, "answers like the base")].output.strip() in html

    # the gate: v2 failed (0 of 2 against v1's 1 of 2), so no traffic; a weight of 0 is fine
    with pytest.raises(InvalidInput) as refused:
        deployment_set_weights(adapter=adapter, weights={1: 90, 2: 10}, actor=member)
    assert "acme/pirate@v2" in refused.value.message and "0 of 2" in refused.value.message
    assert "v1's 1 of 2" in refused.value.message
    deployment_set_weights(adapter=adapter, weights={1: 100, 2: 0}, actor=member)
    r = api.put(f"/api/v1/tenants/{tenant.slug}/adapters/pirate/deployment/", {"weights": {"1": 50, "2": 50}},
                format="json")
    assert r.status_code == 400 and "acme/pirate@v2" in r.json()["detail"], r.content
    assert Deployment.objects.get(adapter=adapter).weights == {"1": 100, "2": 0}  # unchanged by the refusal

    # a threshold the run meets lets it through
    r = api.put(f"/api/v1/tenants/{tenant.slug}/adapters/pirate/deployment/",
                {"evaluation_min_pass_rate": 0.0, "weights": {"1": 90, "2": 10}}, format="json")
    assert r.status_code == 200, r.content
    assert r.json()["weights"] == {"1": 90, "2": 10} and r.json()["require_evaluation"] is True


def test_a_run_whose_worker_dies_midway_fails_with_the_reason_and_runs_again(fleet, worker, tenant, member,
                                                                                 tmp_path):
    same, different = _dirs(tmp_path, fleet.base_config)
    adapter = adapter_create(tenant=tenant, name="flaky", actor=member)
    v1 = AdapterVersion.objects.create(adapter=adapter, number=1, source_path=str(same))
    v2 = AdapterVersion.objects.create(adapter=adapter, number=2, source_path=str(different))
    deployment_set_weights(adapter=adapter, weights={1: 100}, actor=member)
    deployment_set_evaluation_gate(adapter=adapter, require=True, min_pass_rate=None, actor=member)
    evaluation_set = evaluation_set_upload(adapter=adapter, actor=member, data=_jsonl([
        {"name": f"case {i}", "prompt": f"t{i % 290 + 3} t{(7 * i) % 290 + 3} t5", "check": "contains",
         "expected": "t", "max_tokens": 8} for i in range(40)
    ]))
    run = EvaluationRun.objects.create(evaluation_set=evaluation_set, candidate=v2, baseline=v1)

    def execute():
        try:
            evaluation_run_execute(run_id=run.pk)
        finally:
            connection.close()

    thread = threading.Thread(target=execute)
    thread.start()
    deadline = time.monotonic() + 60
    while not EvaluationResult.objects.filter(run=run).exists():
        assert time.monotonic() < deadline, "no case finished"
        time.sleep(0.01)
    worker["proc"].proc.kill()  # the worker is gone mid-run
    thread.join(120)
    assert not thread.is_alive()

    run.refresh_from_db()
    assert run.status == EvaluationRun.Status.FAILED
    # the case that found the worker gone, the version, the worker and what happened (a dropped
    # connection or a refused one, depending on the moment)
    assert "no worker answered" in run.error and "acme/flaky@v" in run.error and worker["proc"].url in run.error
    assert "(line " in run.error
    assert run.candidate_passed is None and run.candidate_rate is None  # never counted as a pass
    stored = EvaluationResult.objects.filter(run=run).count()
    assert 1 <= stored < 80
    refusal = selectors.evaluation_gate_refusal(version=v2, deployment=Deployment.objects.get(adapter=adapter))
    assert "no completed evaluation run" in refusal

    worker["proc"] = worker["proc"].restart()  # same address: the fleet row still points at it
    again = evaluation_run_again(version=v2, actor=member)  # eager: runs now
    again.refresh_from_db()
    assert again.status == EvaluationRun.Status.COMPLETED, again.error
    assert again.trigger == EvaluationRun.Trigger.MANUAL and again.baseline == v1
    assert EvaluationResult.objects.filter(run=again).count() == 80
    assert again.candidate_passed is not None and again.baseline_passed is not None

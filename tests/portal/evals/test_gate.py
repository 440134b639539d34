"""The deployment gate from stored runs (no worker needed): a failing version is refused traffic
with the figures, in the service, the REST API and the console form; weight 0 never is; a
version that served before may serve again; a new ready version is held off traffic."""

from __future__ import annotations

import pytest

from portal.adapters.deployments import deployment_set_evaluation_gate, deployment_set_weights
from portal.adapters.models import AdapterVersion, Deployment
from portal.adapters.services import adapter_create
from portal.core.exceptions import InvalidInput
from portal.evals.models import EvaluationRun, EvaluationSet

pytestmark = pytest.mark.django_db


@pytest.fixture
def bot(tenant, member):
    adapter = adapter_create(tenant=tenant, name="bot", actor=member)
    for n in (1, 2):
        AdapterVersion.objects.create(adapter=adapter, number=n, source_path=f"/x/{n}")
    deployment_set_weights(adapter=adapter, weights={1: 100}, actor=member)
    deployment_set_evaluation_gate(adapter=adapter, require=True, min_pass_rate=None, actor=member)
    return adapter


def completed_run(adapter, *, candidate: int, baseline: int | None, passed: int, baseline_passed: int | None):
    cases = [{"name": f"c{i}", "line": i + 1, "prompt": "x", "check": "exact", "expected": "y", "max_tokens": 4}
             for i in range(4)]
    evaluation_set = EvaluationSet.objects.create(adapter=adapter, cases=cases, case_count=4, checked_count=4,
                                                  size_bytes=1, sha256="0" * 64)
    return EvaluationRun.objects.create(
        evaluation_set=evaluation_set, candidate=adapter.versions.get(number=candidate),
        baseline=adapter.versions.get(number=baseline) if baseline else None, status=EvaluationRun.Status.COMPLETED,
        candidate_passed=passed, baseline_passed=baseline_passed)


def test_no_run_is_refused_a_failing_run_is_refused_with_figures_and_weight_zero_is_fine(bot, member):
    with pytest.raises(InvalidInput, match="acme/bot@v2 cannot receive traffic: it has no completed evaluation run"):
        deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=member)
    with pytest.raises(InvalidInput, match="no completed evaluation run"):
        deployment_set_weights(adapter=bot, weights={}, actor=member)  # {} = the newest ready: v2

    failed = completed_run(bot, candidate=2, baseline=1, passed=1, baseline_passed=3)
    EvaluationRun.objects.filter(pk=failed.pk).update(status=EvaluationRun.Status.FAILED, candidate_passed=None)
    with pytest.raises(InvalidInput, match="no completed evaluation run"):  # a failed run is never a pass
        deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=member)

    run = completed_run(bot, candidate=2, baseline=1, passed=2, baseline_passed=3)
    with pytest.raises(InvalidInput) as refused:
        deployment_set_weights(adapter=bot, weights={1: 90, 2: 10}, actor=member)
    assert refused.value.field == "weights"
    assert refused.value.message == (
        f"acme/bot@v2 cannot receive traffic: its evaluation (run {run.pk}) passed 2 of 4 checked cases (50.0%), "
        "below v1's 3 of 4 (75.0%) in the same run; the deployment requires at least the serving version's pass rate")
    deployment_set_weights(adapter=bot, weights={1: 100, 2: 0}, actor=member)  # rollback / zero: never refused

    deployment_set_evaluation_gate(adapter=bot, require=True, min_pass_rate=0.6, actor=member)
    with pytest.raises(InvalidInput, match=r"below the deployment's minimum of 60.0%"):
        deployment_set_weights(adapter=bot, weights={1: 50, 2: 50}, actor=member)
    deployment_set_evaluation_gate(adapter=bot, require=True, min_pass_rate=0.5, actor=member)
    deployment_set_weights(adapter=bot, weights={1: 50, 2: 50}, actor=member)
    assert Deployment.objects.get(adapter=bot).weights == {"1": 50, "2": 50}


def test_equal_to_the_serving_rate_passes_and_a_former_baseline_may_serve_again(bot, member):
    completed_run(bot, candidate=2, baseline=1, passed=3, baseline_passed=3)
    deployment_set_weights(adapter=bot, weights={2: 100}, actor=member)
    deployment_set_weights(adapter=bot, weights={1: 100}, actor=member)  # v1 served as the baseline: rollback ok


def test_a_newly_ready_version_is_held_off_traffic(tenant, member, bot, settings, tmp_path):
    from portal.adapters.services import _finish_validation

    deployment_set_evaluation_gate(adapter=bot, require=False, min_pass_rate=None, actor=member)
    deployment_set_weights(adapter=bot, weights={}, actor=member)  # the newest ready (v2) serves
    deployment_set_evaluation_gate(adapter=bot, require=True, min_pass_rate=None, actor=member)
    v3 = AdapterVersion.objects.create(adapter=bot, number=3, status=AdapterVersion.Status.VALIDATING,
                                       storage_dir="adapters/none")

    class Result:  # what validate_adapter_dir returns for a good adapter
        rank, alpha, target_modules, base_model, file_sha256, size_bytes, warnings = 4, 8.0, ["q_proj"], "", {}, 1, []

    _finish_validation(v3, [], Result())
    assert AdapterVersion.objects.get(pk=v3.pk).status == AdapterVersion.Status.READY
    assert Deployment.objects.get(adapter=bot).weights == {"2": 100}  # v2 keeps serving; v3 waits
    assert not EvaluationRun.objects.filter(candidate=v3).exists()  # no set: nothing to run


def test_rest_and_console_show_the_refusal(bot, member, api, tenant):
    url = f"/api/v1/tenants/{tenant.slug}/adapters/bot/deployment/"
    r = api.put(url, {"weights": {"1": 50, "2": 50}}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "weights" and "acme/bot@v2" in r.json()["detail"]
    r = api.put(url, {"evaluation_min_pass_rate": 1.5}, format="json")
    assert r.status_code == 400 and "evaluation_min_pass_rate" in r.json()["detail"]
    r = api.get(url)
    assert r.json()["require_evaluation"] is True and r.json()["evaluation_min_pass_rate"] is None

    page = api.post(f"/t/{tenant.slug}/adapters/bot/deployment/", {"weight_1": "50", "weight_2": "50"})
    assert page.status_code == 400 and "acme/bot@v2 cannot receive traffic" in page.content.decode()
    version_page = api.get(f"/t/{tenant.slug}/adapters/bot/versions/2/").content.decode()
    assert "Gate: acme/bot@v2 cannot receive traffic" in version_page
    assert api.get(f"/t/{tenant.slug}/adapters/bot/").content.decode().count("/adapters/bot/evaluation/") >= 1

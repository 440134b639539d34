"""Reads: an adapter's evaluation set, a version's runs, the side-by-side comparison of a run,
which version serves now (a run's baseline), and the deployment gate's verdict."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import QuerySet

from portal.adapters.models import Adapter, AdapterVersion, Deployment
from portal.evals.models import EvaluationResult, EvaluationRun, EvaluationSet

Verdict = EvaluationResult.Verdict
PASSING = {Verdict.PASS}


def evaluation_set_current(*, adapter: Adapter) -> EvaluationSet | None:
    """The adapter's set: its newest upload."""
    return EvaluationSet.objects.filter(adapter=adapter).select_related("created_by").order_by("-id").first()


def evaluation_run_list(*, version: AdapterVersion) -> QuerySet[EvaluationRun]:
    """The runs that evaluated `version` (as the candidate), newest first."""
    return (EvaluationRun.objects.filter(candidate=version)
            .select_related("evaluation_set", "candidate__adapter__tenant", "baseline", "created_by")
            .order_by("-id"))


def evaluation_run_get(*, version: AdapterVersion, run_id: int) -> EvaluationRun | None:
    return evaluation_run_list(version=version).filter(pk=run_id).first()


def evaluation_run_latest_completed(*, version: AdapterVersion) -> EvaluationRun | None:
    return evaluation_run_list(version=version).filter(status=EvaluationRun.Status.COMPLETED).first()


def evaluation_runs_by_version(*, adapter: Adapter) -> dict[int, EvaluationRun]:
    """{version number: its newest run} for the adapter's versions that have one."""
    latest: dict[int, EvaluationRun] = {}
    runs = (EvaluationRun.objects.filter(candidate__adapter=adapter)
            .select_related("evaluation_set", "candidate", "baseline").order_by("-id"))
    for run in runs:
        latest.setdefault(run.candidate.number, run)
    return latest


def serving_version(*, adapter: Adapter, exclude: AdapterVersion | None = None) -> AdapterVersion | None:
    """The version serving `adapter` now other than `exclude`: the ready version with the highest
    deployment weight (the higher number on a tie), else the newest ready one; None if none."""
    ready = list(adapter.versions.filter(status=AdapterVersion.Status.READY, retired_at__isnull=True)
                 .select_related("adapter__tenant"))
    ready = [v for v in ready if exclude is None or v.pk != exclude.pk]
    if not ready:
        return None
    deployment = Deployment.objects.filter(adapter=adapter).first()
    weights = {int(n): int(w) for n, w in ((deployment.weights if deployment else None) or {}).items()}
    weighted = [v for v in ready if weights.get(v.number, 0) > 0]
    if weighted:
        return max(weighted, key=lambda v: (weights[v.number], v.number))
    return max(ready, key=lambda v: v.number)


@dataclass(frozen=True)
class CaseRow:
    index: int
    name: str
    line: int
    check: str | None
    candidate: EvaluationResult | None
    baseline: EvaluationResult | None

    @property
    def changed(self) -> bool:
        """The verdict differs between the two versions (pass on one, fail or error on the other)."""
        if self.candidate is None or self.baseline is None or not self.check:
            return False
        return (self.candidate.verdict in PASSING) != (self.baseline.verdict in PASSING)


def evaluation_run_rows(*, run: EvaluationRun) -> list[CaseRow]:
    """One row per case of the run's set, with each version's result (None: not run)."""
    results: dict[tuple[int, int], EvaluationResult] = {
        (r.version_id, r.case_index): r for r in EvaluationResult.objects.filter(run=run)
    }
    rows = []
    for index, case in enumerate(run.evaluation_set.cases):
        rows.append(CaseRow(
            index=index, name=case["name"], line=case["line"], check=case.get("check"),
            candidate=results.get((run.candidate_id, index)),
            baseline=results.get((run.baseline_id, index)) if run.baseline_id else None,
        ))
    return rows


def _percent(rate: float | None) -> str:
    return "none" if rate is None else f"{rate:.1%}"


def evaluation_gate_refusal(*, version: AdapterVersion, deployment: Deployment) -> str | None:
    """Why `version` may not receive traffic under the deployment's evaluation gate, or None.

    Passing: the latest completed run with `version` as the candidate has a pass rate at or
    above evaluation_min_pass_rate when one is set, else at or above the pass rate of the
    version that was serving in that run (no such version: passing). A version that served as
    a run's baseline has served before: it may serve again (a rollback). Runs that failed or
    are still running never count."""
    if not deployment.require_evaluation:
        return None
    if EvaluationRun.objects.filter(baseline=version).exists():
        return None
    name = version.public_id
    run = evaluation_run_latest_completed(version=version)
    if run is None:
        in_flight = evaluation_run_list(version=version).filter(
            status__in=[EvaluationRun.Status.QUEUED, EvaluationRun.Status.RUNNING]).exists()
        if in_flight:
            return f"{name} cannot receive traffic yet: its evaluation is still running, and the deployment requires it to pass"
        return (f"{name} cannot receive traffic: it has no completed evaluation run, and the deployment requires "
                f"one that passes (upload an evaluation set for {version.adapter.public_id}, or run it again)")
    rate = run.candidate_rate
    figures = f"its evaluation (run {run.pk}) passed {run.candidate_passed} of {run.checked_count} checked cases ({_percent(rate)})"
    threshold = deployment.evaluation_min_pass_rate
    if threshold is not None:
        if rate is not None and rate >= threshold:
            return None
        return f"{name} cannot receive traffic: {figures}, below the deployment's minimum of {_percent(threshold)}"
    baseline_rate = run.baseline_rate
    if run.baseline_id is None or rate is not None and baseline_rate is not None and rate >= baseline_rate:
        return None
    return (f"{name} cannot receive traffic: {figures}, below v{run.baseline.number}'s "
            f"{run.baseline_passed} of {run.checked_count} ({_percent(baseline_rate)}) in the same run; "
            "the deployment requires at least the serving version's pass rate")

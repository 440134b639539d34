"""Writes: upload an adapter's evaluation set, make a run (when a version becomes ready, or by
hand), execute a run against the workers (the Celery task's body).

    evaluation_set_upload(adapter=, data=, filename=, actor=)   checked line by line
        (portal.evals.validation); refused -> InvalidInput("file", every line and reason), nothing
        stored. A new upload replaces the set; old sets stay for the runs that used them.
    evaluation_on_version_ready(version=)   in the transaction that marks a version ready: a
        queued run (candidate = it, baseline = the version serving now) if the adapter has a set
    evaluation_run_again(version=, actor=)   a fresh run by hand (after a failed one, a new set)
    evaluation_run_execute(run_id=)   candidate's cases, then the baseline's; WorkerGone or any
        error -> failed with the reason (never a pass rate); else completed with both counts
"""

from __future__ import annotations

import logging
from datetime import timedelta

from celery.exceptions import SoftTimeLimitExceeded
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from portal.adapters.models import Adapter, AdapterVersion, AuditEvent
from portal.core.exceptions import InvalidInput
from portal.core.jobs import enqueue_on_commit
from portal.evals import selectors
from portal.evals.checks import judge
from portal.evals.models import EvaluationResult, EvaluationRun, EvaluationSet
from portal.evals.runner import WorkerGone, run_cases
from portal.evals.validation import EvaluationFileError, parse_cases
from portal.fleet.selectors import base_model_config

logger = logging.getLogger(__name__)

RUN_TASK = "portal.evals.tasks.evaluation_run_task"
# A run still "running" after this long died with its Celery worker (the task's hard limit is
# shorter): a new run may start.
STALE_RUN = timedelta(hours=1)
UNEXPECTED = "the run failed unexpectedly (the error is logged); run it again"


def _user(actor):
    return actor if actor is not None and getattr(actor, "is_authenticated", False) else None


def _audit(*, adapter: Adapter, actor, action: str, target: str, details: dict) -> None:
    AuditEvent.objects.create(tenant=adapter.tenant, actor=_user(actor), action=action, target=target,
                              details=details)


def context_length() -> int | None:
    """The fleet's context length (max_model_len from the workers' /v1/base_model), if known."""
    value = (base_model_config() or {}).get("max_model_len")
    return value if isinstance(value, int) and value > 0 else None


def evaluation_set_upload(*, adapter: Adapter, data: bytes, filename: str = "",
                          actor: AbstractBaseUser | None) -> EvaluationSet:
    """Store `data` (JSONL) as the adapter's evaluation set, or refuse it whole."""
    try:
        parsed = parse_cases(data, context_length=context_length())
    except EvaluationFileError as error:
        raise InvalidInput("file", "; ".join(error.problems)) from None
    with transaction.atomic():
        evaluation_set = EvaluationSet.objects.create(
            adapter=adapter, cases=parsed.cases, case_count=len(parsed.cases), checked_count=parsed.checked_count,
            filename=(filename or "")[:255], size_bytes=parsed.size_bytes, sha256=parsed.sha256,
            created_by=_user(actor),
        )
        _audit(adapter=adapter, actor=actor, action="evaluation_set.uploaded", target=adapter.public_id,
               details={"cases": evaluation_set.case_count, "checked": evaluation_set.checked_count,
                        "sha256": evaluation_set.sha256})
    return evaluation_set


def _run_create(*, version: AdapterVersion, evaluation_set: EvaluationSet, trigger: str, actor) -> EvaluationRun:
    run = EvaluationRun.objects.create(
        evaluation_set=evaluation_set, candidate=version,
        baseline=selectors.serving_version(adapter=version.adapter, exclude=version),
        trigger=trigger, created_by=_user(actor),
    )
    enqueue_on_commit(RUN_TASK, run.pk)
    return run


def evaluation_on_version_ready(*, version: AdapterVersion) -> EvaluationRun | None:
    """Called as `version` becomes ready (inside that transaction): a queued run against the
    version serving now when the adapter has a set; None otherwise."""
    evaluation_set = selectors.evaluation_set_current(adapter=version.adapter)
    if evaluation_set is None:
        return None
    return _run_create(version=version, evaluation_set=evaluation_set,
                       trigger=EvaluationRun.Trigger.VERSION_READY, actor=None)


def evaluation_run_again(*, version: AdapterVersion, actor: AbstractBaseUser | None) -> EvaluationRun:
    """A new run of the adapter's current set on `version`, against the version serving now."""
    with transaction.atomic():
        version = AdapterVersion.objects.select_for_update().select_related("adapter__tenant").get(pk=version.pk)
        if version.status != AdapterVersion.Status.READY:
            raise InvalidInput("version", f"{version.public_id} is {version.status}: only a ready version can be evaluated")
        evaluation_set = selectors.evaluation_set_current(adapter=version.adapter)
        if evaluation_set is None:
            raise InvalidInput("version", f"{version.adapter.public_id} has no evaluation set: upload one first")
        busy = selectors.evaluation_run_list(version=version).filter(
            status__in=[EvaluationRun.Status.QUEUED, EvaluationRun.Status.RUNNING],
            created_at__gte=timezone.now() - STALE_RUN).first()
        if busy is not None:
            raise InvalidInput("version", f"run {busy.pk} of {version.public_id} is still {busy.status}: wait for it to end")
        run = _run_create(version=version, evaluation_set=evaluation_set, trigger=EvaluationRun.Trigger.MANUAL,
                          actor=actor)
        _audit(adapter=version.adapter, actor=actor, action="evaluation_run.requested", target=version.public_id,
               details={"run": run.pk})
    return run


def evaluation_run_execute(*, run_id: int) -> EvaluationRun | None:
    """Run every case on the candidate, then on the baseline, storing each result as it comes.
    A run already finished (or gone) is left alone: None. A redelivered run starts over."""
    with transaction.atomic():
        run = (EvaluationRun.objects.select_for_update(of=("self",))
               .select_related("evaluation_set", "candidate__adapter__tenant", "baseline__adapter__tenant")
               .filter(pk=run_id).first())
        if run is None or run.status not in (EvaluationRun.Status.QUEUED, EvaluationRun.Status.RUNNING):
            return None
        run.results.all().delete()
        run.status, run.started_at, run.error = EvaluationRun.Status.RUNNING, timezone.now(), ""
        run.save(update_fields=["status", "started_at", "error"])
    cases = run.evaluation_set.cases
    passed: dict[int, int] = {}
    try:
        for version in [run.candidate, run.baseline]:
            if version is None:
                continue
            if version.status != AdapterVersion.Status.READY:
                raise WorkerGone(f"{version.public_id} is {version.status}: it can no longer be served")
            passed[version.pk] = 0
            for outcome in run_cases(version=version, cases=cases):
                case = cases[outcome.index]
                verdict, detail = _verdict(case, outcome)
                passed[version.pk] += verdict == EvaluationResult.Verdict.PASS
                EvaluationResult.objects.create(
                    run=run, version=version, case_index=outcome.index, case_name=case["name"],
                    output=outcome.output, verdict=verdict, detail=detail, latency_ms=outcome.latency_ms,
                    completion_tokens=outcome.completion_tokens, finish_reason=outcome.finish_reason,
                )
    except WorkerGone as gone:
        return _finish(run, status=EvaluationRun.Status.FAILED, error=str(gone))
    except SoftTimeLimitExceeded:
        return _finish(run, status=EvaluationRun.Status.FAILED,
                       error="the run took longer than its time limit (Celery's soft limit); run it again")
    except Exception as error:  # noqa: BLE001 -- the run is failed with a reason, never left running
        logger.exception("evaluation run %s failed", run.pk)
        reason = f"{UNEXPECTED} ({type(error).__name__})"
        return _finish(run, status=EvaluationRun.Status.FAILED, error=reason)
    return _finish(run, status=EvaluationRun.Status.COMPLETED, candidate_passed=passed.get(run.candidate_id),
                   baseline_passed=passed.get(run.baseline_id) if run.baseline_id else None)


def _verdict(case: dict, outcome) -> tuple[str, str]:
    Verdict = EvaluationResult.Verdict
    if outcome.error:
        return Verdict.ERROR, outcome.error
    ok, detail = judge(case.get("check"), case.get("expected"), outcome.output)
    if ok is None:
        return Verdict.UNCHECKED, ""
    return (Verdict.PASS if ok else Verdict.FAIL), detail


def _finish(run: EvaluationRun, *, status: str, error: str = "", candidate_passed: int | None = None,
            baseline_passed: int | None = None) -> EvaluationRun:
    with transaction.atomic():
        run.status, run.error, run.finished_at = status, error, timezone.now()
        run.candidate_passed, run.baseline_passed = candidate_passed, baseline_passed
        run.save(update_fields=["status", "error", "finished_at", "candidate_passed", "baseline_passed"])
        details = {"run": run.pk, "status": status}
        if status == EvaluationRun.Status.COMPLETED:
            details.update(candidate_passed=candidate_passed, baseline_passed=baseline_passed,
                           checked=run.checked_count, baseline=run.baseline.public_id if run.baseline else None)
        else:
            details["error"] = error
        _audit(adapter=run.candidate.adapter, actor=None, action=f"evaluation_run.{status}",
               target=run.candidate.public_id, details=details)
    return run

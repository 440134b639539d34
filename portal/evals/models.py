"""Evaluation sets per adapter and the runs that score a version against them.

    EvaluationSet     one uploaded JSONL per row; the adapter's newest row is its set (older
                      rows stay: the runs that used them keep their cases)
      └─ EvaluationRun       one version (candidate) against the version serving when the run
                             was made (baseline, None when nothing else served), on one set
           └─ EvaluationResult   one case on one of those versions: output, verdict, latency

Pass rates are of the cases that have a check; a run that did not complete has none, so a run
that failed midway is never counted as a pass.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from portal.adapters.models import Adapter, AdapterVersion


class EvaluationSet(models.Model):
    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="evaluation_sets")
    # The cases as portal.evals.validation.parse_cases normalised them: [{"name", "line",
    # "prompt" | "messages", "check", "expected", "max_tokens"}, ...]
    cases = models.JSONField(default=list)
    case_count = models.PositiveIntegerField()
    checked_count = models.PositiveIntegerField()  # cases with a check: the pass rates' denominator
    filename = models.CharField(max_length=255, blank=True)
    size_bytes = models.PositiveIntegerField()
    sha256 = models.CharField(max_length=64)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["adapter", "-id"]

    def __str__(self) -> str:
        return f"evaluation set {self.pk} of {self.adapter.public_id} ({self.case_count} cases)"


class EvaluationRun(models.Model):
    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        COMPLETED = "completed", "Completed"
        FAILED = "failed", "Failed"

    class Trigger(models.TextChoices):
        VERSION_READY = "version_ready", "Version became ready"
        MANUAL = "manual", "Run again by hand"

    evaluation_set = models.ForeignKey(EvaluationSet, on_delete=models.CASCADE, related_name="runs")
    candidate = models.ForeignKey(AdapterVersion, on_delete=models.CASCADE, related_name="evaluation_runs")
    baseline = models.ForeignKey(
        AdapterVersion, on_delete=models.CASCADE, null=True, blank=True, related_name="baseline_runs"
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.VERSION_READY)
    error = models.TextField(blank=True)  # why a failed run failed
    candidate_passed = models.PositiveIntegerField(null=True, blank=True)  # set when completed
    baseline_passed = models.PositiveIntegerField(null=True, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        indexes = [models.Index(fields=["candidate", "status", "-id"], name="evalrun_candidate_status")]

    def __str__(self) -> str:
        return f"evaluation run {self.pk} of {self.candidate.public_id}"

    @property
    def checked_count(self) -> int:
        return self.evaluation_set.checked_count

    @property
    def candidate_rate(self) -> float | None:
        return _rate(self.candidate_passed, self.checked_count) if self.status == self.Status.COMPLETED else None

    @property
    def baseline_rate(self) -> float | None:
        if self.status != self.Status.COMPLETED or self.baseline_id is None:
            return None
        return _rate(self.baseline_passed, self.checked_count)


def _rate(passed: int | None, checked: int) -> float | None:
    return None if passed is None or checked <= 0 else passed / checked


class EvaluationResult(models.Model):
    class Verdict(models.TextChoices):
        PASS = "pass", "Pass"
        FAIL = "fail", "Fail"
        ERROR = "error", "Error"  # the worker refused the case (e.g. 400): counted as a fail
        UNCHECKED = "unchecked", "No check"  # the case has no check: output recorded only

    run = models.ForeignKey(EvaluationRun, on_delete=models.CASCADE, related_name="results")
    version = models.ForeignKey(AdapterVersion, on_delete=models.CASCADE, related_name="+")
    case_index = models.PositiveIntegerField()  # position in the set's cases
    case_name = models.CharField(max_length=200)
    output = models.TextField(blank=True)
    verdict = models.CharField(max_length=16, choices=Verdict.choices)
    detail = models.TextField(blank=True)  # why it failed, or the worker's error
    latency_ms = models.FloatField()
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    finish_reason = models.CharField(max_length=32, blank=True)

    class Meta:
        ordering = ["run", "case_index", "version"]
        constraints = [
            models.UniqueConstraint(fields=["run", "version", "case_index"], name="evalresult_one_per_case"),
        ]

    def __str__(self) -> str:
        return f"{self.case_name}: {self.verdict}"

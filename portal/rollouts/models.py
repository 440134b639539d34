"""Safe rollouts, live side: what users thought of a completion, and the canary guard.

    Feedback      one rating (up/down, optional comment) of one completion per source (the
                  playground, the API); a second rating from the same source replaces the first.
                  Joined to the ledger row that served it, so it is counted by adapter version.
    CanaryGuard   per deployment: the thresholds the guard (tasks.canary_guard_check_task, every
                  minute) holds a canary to, and its last rollback, shown on the adapter page as a
                  banner until dismissed or until the weights are set again.
"""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from portal.adapters.models import AdapterVersion, Deployment
from portal.tenants.models import Tenant
from portal.usage.models import UsageRecord

COMPLETION_ID_MAX_LENGTH = 200
COMMENT_MAX_LENGTH = 2000


class Feedback(models.Model):
    class Rating(models.TextChoices):
        UP = "up", "thumbs up"
        DOWN = "down", "thumbs down"

    class Source(models.TextChoices):
        PLAYGROUND = "playground", "playground"
        API = "api", "API"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="feedback")
    # The id the client saw (chatcmpl-..., cmpl-...), as the ledger holds it.
    completion_id = models.CharField(max_length=COMPLETION_ID_MAX_LENGTH)
    usage_record = models.ForeignKey(UsageRecord, on_delete=models.SET_NULL, null=True, blank=True,
                                     related_name="feedback")
    # Copied from the ledger row: the per-version comparison counts feedback without a join.
    adapter_version = models.ForeignKey(AdapterVersion, on_delete=models.SET_NULL, null=True, blank=True,
                                        related_name="feedback")
    rating = models.CharField(max_length=8, choices=Rating.choices)
    comment = models.TextField(blank=True, max_length=COMMENT_MAX_LENGTH)
    source = models.CharField(max_length=16, choices=Source.choices)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True,
                             related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "completion_id", "source"], name="feedback_one_per_source"),
        ]
        indexes = [models.Index(fields=["adapter_version", "created_at"], name="feedback_version_created")]

    def __str__(self) -> str:
        return f"{self.completion_id} {self.rating} ({self.source})"


class CanaryGuard(models.Model):
    """The automatic rollback of one deployment's canaries (versions weighted below the serving one)."""

    deployment = models.OneToOneField(Deployment, on_delete=models.CASCADE, related_name="canary_guard")
    enabled = models.BooleanField(default=True)
    # Canary requests (since its weight was last set) before the guard judges it at all.
    min_requests = models.PositiveIntegerField(default=50, validators=[MinValueValidator(1),
                                                                       MaxValueValidator(1_000_000)])
    # Absolute: 0.05 rolls back a canary failing 7% of requests when the stable one fails 1%.
    error_rate_margin = models.FloatField(default=0.05, validators=[MinValueValidator(0.0),
                                                                    MaxValueValidator(1.0)])
    # The canary's TTFT p95 over the stable one's: 2.0 rolls back at twice as slow.
    ttft_p95_factor = models.FloatField(default=2.0, validators=[MinValueValidator(1.0),
                                                                 MaxValueValidator(1000.0)])
    last_checked_at = models.DateTimeField(null=True, blank=True)
    # The last rollback: the version, when, and the figures that triggered it (also in its
    # AuditEvent). The banner shows while banner_dismissed is False and no weights were set since.
    rolled_back_version = models.ForeignKey(AdapterVersion, on_delete=models.SET_NULL, null=True, blank=True,
                                            related_name="+")
    rolled_back_at = models.DateTimeField(null=True, blank=True)
    rollback_figures = models.JSONField(default=dict, blank=True)
    rollback_event_id = models.BigIntegerField(null=True, blank=True)  # the AuditEvent's id
    banner_dismissed = models.BooleanField(default=False)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"canary guard of {self.deployment_id}"

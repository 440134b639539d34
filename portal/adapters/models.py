"""A tenant's adapters and their immutable versions.

    Adapter          tenant + name (what the tenant calls it: `tenant-slug/name` on the API)
      └─ AdapterVersion  number (v1, v2, ...), uid (the immutable id the workers know it by),
                         where the workers read its files, status

      Deployment     per adapter: weights over its versions (canary splits, rollback)
      AuditEvent     who changed what, per tenant

Tenants upload versions (status uploaded -> validating -> ready | rejected); staff may still
register a version in the Django admin with a `source_path` the inference workers can read.
"""

from __future__ import annotations

import uuid

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from portal.tenants.models import Tenant

validate_adapter_name = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,62}[a-z0-9]$|^[a-z0-9]$",
    "Use 1-64 lowercase letters, digits, dots, underscores or hyphens, starting and ending with a letter or digit.",
)


class Adapter(models.Model):
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=64, validators=[validate_adapter_name])
    description = models.TextField(blank=True)
    base_model = models.CharField(max_length=200, blank=True, help_text="The base model it was trained on.")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["tenant__slug", "name"]
        constraints = [models.UniqueConstraint(fields=["tenant", "name"], name="adapter_unique_name_per_tenant")]

    def __str__(self) -> str:
        return self.public_id

    @property
    def public_id(self) -> str:
        return f"{self.tenant.slug}/{self.name}"


class AdapterVersion(models.Model):
    class Status(models.TextChoices):
        UPLOADED = "uploaded", "Uploaded"
        VALIDATING = "validating", "Validating"
        READY = "ready", "Ready"
        REJECTED = "rejected", "Rejected"
        RETIRED = "retired", "Retired"

    adapter = models.ForeignKey(Adapter, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    # The id inference workers know this version by; never reused, so no worker cache keyed
    # by it can serve other weights.
    uid = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    source_path = models.CharField(
        max_length=1000, blank=True, help_text="The PEFT adapter directory as the inference workers see it."
    )
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.READY)
    sha256 = models.CharField(max_length=64, blank=True)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    rank = models.PositiveIntegerField(null=True, blank=True)
    alpha = models.FloatField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    rejection_reasons = models.JSONField(default=list, blank=True)
    # Storage-relative directory holding adapter_config.json + adapter_model.safetensors
    # after extraction (empty for staff-registered versions that only have source_path).
    storage_dir = models.CharField(max_length=500, blank=True)
    # {filename: sha256 hex} of the stored files: what a worker checks after downloading.
    file_sha256 = models.JSONField(default=dict, blank=True)
    base_model = models.CharField(max_length=200, blank=True, help_text="base_model_name_or_path from its config.")
    validated_at = models.DateTimeField(null=True, blank=True)
    retired_at = models.DateTimeField(null=True, blank=True)
    # {worker_url: {"status": "pending|staged|failed", "attempts": n, "error": str, "at": iso}}
    staging = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["adapter", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["adapter", "number"], name="adapter_version_unique_number"),
        ]

    def __str__(self) -> str:
        return self.public_id

    @property
    def public_id(self) -> str:
        return f"{self.adapter.public_id}@v{self.number}"

    @property
    def worker_name(self) -> str:
        """The adapter's name on the inference workers (`lora_name`)."""
        return f"lora-{self.uid.hex}"


class Deployment(models.Model):
    """How `tenant/name` (no @vN) picks a version: weights over version numbers.

    weights: {"<version number>": int weight}, e.g. {"3": 90, "4": 10}; empty means the
    newest ready version."""

    adapter = models.OneToOneField(Adapter, on_delete=models.CASCADE, related_name="deployment")
    weights = models.JSONField(default=dict, blank=True)
    always_warm = models.BooleanField(default=False)
    # The evaluation gate (portal.evals): a version may get a positive weight only when its
    # latest completed evaluation run passed: a pass rate >= evaluation_min_pass_rate, or, when
    # that is null, >= the serving version's in the same run.
    require_evaluation = models.BooleanField(default=False)
    evaluation_min_pass_rate = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)],
        help_text="0..1; empty: at least the serving version's pass rate.",
    )
    updated_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"deployment of {self.adapter.public_id}"


class AuditEvent(models.Model):
    """One change a person (or the system, actor None) made to a tenant's adapters."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="audit_events")
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    action = models.CharField(max_length=64, db_index=True)  # e.g. "version.uploaded"
    target = models.CharField(max_length=300, blank=True)  # e.g. "acme/bot@v3"
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="audit_tenant_created")]

    def __str__(self) -> str:
        return f"{self.action} {self.target}"

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models

# Tenant slugs are the first half of public model ids ("acme/support-bot"), so keep them
# lowercase, URL-safe and free of "/" and "@".
TENANT_SLUG_PATTERN = r"^[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?$"
validate_tenant_slug = RegexValidator(
    TENANT_SLUG_PATTERN,
    "Use 1-50 lowercase letters, digits or hyphens, starting and ending with a letter or digit.",
)


class Tenant(models.Model):
    class Plan(models.TextChoices):
        FREE = "free", "Free"
        TEAM = "team", "Team"
        ENTERPRISE = "enterprise", "Enterprise"

    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    slug = models.CharField(max_length=50, unique=True, validators=[validate_tenant_slug])
    name = models.CharField(max_length=200)
    plan = models.CharField(max_length=20, choices=Plan.choices, default=Plan.FREE)
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.ACTIVE)
    # The tenant's TTFT objective: p95 time to first token in ms; None takes the plan's target
    # (portal.tenants.plans). The dashboards show the share of requests meeting it.
    ttft_p95_target_ms = models.PositiveIntegerField(
        null=True, blank=True, verbose_name="TTFT p95 target (ms)",
        help_text="Overrides the plan's time-to-first-token objective; empty: the plan's.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        ADMIN = "admin", "Admin"
        MEMBER = "member", "Member"
        VIEWER = "viewer", "Viewer"

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=20, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__slug", "user__username"]
        constraints = [
            models.UniqueConstraint(
                fields=["user", "tenant"], name="unique_membership_per_user_tenant"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user} in {self.tenant} ({self.role})"

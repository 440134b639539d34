from decimal import Decimal

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from portal.keys.models import ApiKey
from portal.tenants.models import Tenant

LIMIT_FIELDS = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "monthly_token_budget",
    "monthly_spend_limit",
)
SPEND_DECIMAL_PLACES = 6  # micro-USD: fine enough for one small request's cost


class Quota(models.Model):
    """Explicit limits for one tenant or one API key (exactly one of the two).

    A null limit falls back: on a tenant's row to the tenant's plan (portal/tenants/plans.py),
    on a key's row to no key-level limit (the tenant's limits still apply to the key).
    """

    tenant = models.OneToOneField(
        Tenant, on_delete=models.CASCADE, null=True, blank=True, related_name="quota"
    )
    api_key = models.OneToOneField(
        ApiKey, on_delete=models.CASCADE, null=True, blank=True, related_name="quota"
    )
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    tokens_per_minute = models.PositiveBigIntegerField(null=True, blank=True)
    max_concurrent_requests = models.PositiveIntegerField(null=True, blank=True)
    monthly_token_budget = models.PositiveBigIntegerField(null=True, blank=True)
    # In the plan's currency (USD, portal/tenants/plans.py), priced like the monthly statement.
    monthly_spend_limit = models.DecimalField(
        max_digits=18, decimal_places=SPEND_DECIMAL_PLACES, null=True, blank=True,
        validators=[MinValueValidator(Decimal(0))],
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=Q(tenant__isnull=False, api_key__isnull=True)
                | Q(tenant__isnull=True, api_key__isnull=False),
                name="quota_for_exactly_one_tenant_or_key",
            ),
        ]

    def __str__(self) -> str:
        return f"quota for {self.owner_label}"

    @property
    def owner_label(self) -> str:
        if self.api_key_id is not None:
            return f"key {self.api_key}"
        return f"tenant {self.tenant}" if self.tenant_id is not None else "nobody"

    def clean(self) -> None:
        if (self.tenant_id is None) == (self.api_key_id is None):
            raise ValidationError("A quota is for exactly one tenant or one API key, not both.")

from django.conf import settings
from django.db import models
from django.utils import timezone

from portal.tenants.models import Tenant

API_KEY_PREFIX = "sk-"
VISIBLE_PREFIX_CHARS = 8  # of the secret after "sk-": enough to tell keys apart in a list


class ApiKey(models.Model):
    """A tenant's key for the API. Only a hash of the secret is stored; it is shown once."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=VISIBLE_PREFIX_CHARS, db_index=True, editable=False)
    # sha256 hex of the whole plaintext key. A fast hash is right here: the secret has 256
    # bits of entropy, so there is nothing for a slow password hash to protect against.
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="created_api_keys",
    )
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    # None: any model the tenant may use; a list: only these public model ids.
    allowed_models = models.JSONField(null=True, blank=True, default=None)
    # After a rotation the secret it replaced still authenticates until previous_valid_until
    # (the grace period), so clients can be switched over without an outage.
    previous_secret_hash = models.CharField(max_length=64, null=True, blank=True, db_index=True, editable=False)
    previous_valid_until = models.DateTimeField(null=True, blank=True, editable=False)
    rotated_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["tenant__slug", "-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        return f"{API_KEY_PREFIX}{self.prefix}…"

    def is_usable(self, now=None) -> bool:
        now = now or timezone.now()
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > now)

"""The inference workers the gateway routes to, and what the last poll saw on each."""

from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.db import models

# Adapter tiers on a worker (its GET /v1/adapters) that count as "resident" for routing: in
# memory or already on its way there. "disk" (registered, evicted) and "failed" do not.
RESIDENT_TIERS = ("device", "host", "loading")


def normalize_worker_url(value: str) -> str:
    """`http(s)://host[:port][/prefix]` without a trailing slash; ValueError otherwise."""
    value = (value or "").strip()
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {value!r}")
    try:
        parts.port  # noqa: B018 -- raises ValueError on a non-numeric port
    except ValueError:
        raise ValueError(f"bad port in {value!r}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"a worker URL takes no query or fragment: {value!r}")
    return value.rstrip("/")


def validate_worker_url(value: str) -> None:
    try:
        normalize_worker_url(value)
    except ValueError as error:
        raise ValidationError(str(error)) from None


class InferenceWorker(models.Model):
    """One `python -m inference serve` process. Rows come from settings.INFERENCE_URLS
    (fleet_sync_from_settings) or from staff in the admin; the poll fields are written by
    worker_poll only."""

    # Not a URLField: Django's URL validator wants a dotted host, and workers are usually
    # reached by a bare service name ("http://inference-0:8001").
    url = models.CharField(max_length=500, unique=True, validators=[validate_worker_url])
    name = models.CharField(max_length=100, blank=True)
    enabled = models.BooleanField(default=True, help_text="Disabled workers get no traffic and are not polled.")

    # What the last poll saw.
    healthy = models.BooleanField(default=False, editable=False)
    base_model = models.CharField(max_length=200, blank=True, editable=False)
    last_polled_at = models.DateTimeField(null=True, blank=True, editable=False)
    last_seen_at = models.DateTimeField(null=True, blank=True, editable=False)  # last healthy poll
    last_error = models.TextField(blank=True, editable=False)
    num_running = models.PositiveIntegerField(default=0, editable=False)
    num_waiting = models.PositiveIntegerField(default=0, editable=False)
    kv_cache_usage = models.FloatField(default=0.0, editable=False)  # 0..1
    resident_adapters = models.JSONField(default=dict, blank=True, editable=False)  # {lora_name: tier}
    memory = models.JSONField(default=dict, blank=True, editable=False)  # {kind: bytes}
    # The base's shapes and adapter limits from GET /v1/base_model (what uploads validate against).
    base_config = models.JSONField(default=dict, blank=True, editable=False)
    # The worker's adapter-cache counters since it started (its loraplex:lora_cache_* metrics):
    # {"hits": {tier: n}, "misses": n, "loads": n, "load_failures": n, "evictions": {tier: n}}.
    cache_stats = models.JSONField(default=dict, blank=True, editable=False)

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["url"]
        verbose_name = "inference worker"

    def __str__(self) -> str:
        return self.name or self.url

    def clean(self) -> None:
        try:
            self.url = normalize_worker_url(self.url)
        except ValueError:
            pass  # the field's validator has reported it

    @property
    def load(self) -> int:
        """Requests on the worker at the last poll (running + waiting)."""
        return self.num_running + self.num_waiting

    def has_resident(self, lora_name: str) -> bool:
        return self.resident_adapters.get(lora_name) in RESIDENT_TIERS

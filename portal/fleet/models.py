"""The inference workers the gateway routes to, and what the last poll saw on each."""

from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.db import models

# Adapter tiers on a worker (its GET /v1/adapters) that count as "resident" for routing: in
# memory or already on its way there. "disk" (registered, evicted) and "failed" do not.
RESIDENT_TIERS = ("device", "host", "loading")
# How last_error begins for a worker the poll found serving another base model than the fleet.
BASE_MISMATCH = "base model mismatch"
WORKER_STATES = ("healthy", "unhealthy", "mismatched", "gone", "disabled")


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
    (fleet_sync_from_settings), from DNS discovery (settings.INFERENCE_DISCOVERY: one row per
    address record) or from staff in the admin; the poll fields are written by the poll only."""

    # Not a URLField: Django's URL validator wants a dotted host, and workers are usually
    # reached by a bare service name ("http://inference-0:8001").
    url = models.CharField(max_length=500, unique=True, validators=[validate_worker_url])
    name = models.CharField(max_length=100, blank=True)
    enabled = models.BooleanField(default=True, help_text="Disabled workers get no traffic and are not polled.")
    # The discovery name ("dns://inference-headless:8001") whose answer listed this worker; blank
    # for workers from INFERENCE_URLS or the admin.
    discovered_by = models.CharField(max_length=300, blank=True, editable=False)
    # When the discovery name's answer stopped listing it (the pod left): not polled, not routed.
    gone_since = models.DateTimeField(null=True, blank=True, editable=False)

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
    def state(self) -> str:
        """One word for dashboards and /metrics (WORKER_STATES): disabled in the admin; gone from
        its DNS name; mismatched (serves another base model than the fleet); healthy or unhealthy
        at the last poll (last_error says why)."""
        if not self.enabled:
            return "disabled"
        if self.gone_since is not None:
            return "gone"
        if self.healthy:
            return "healthy"
        return "mismatched" if self.last_error.startswith(BASE_MISMATCH) else "unhealthy"

    @property
    def load(self) -> int:
        """Requests on the worker at the last poll (running + waiting)."""
        return self.num_running + self.num_waiting

    def has_resident(self, lora_name: str) -> bool:
        return self.resident_adapters.get(lora_name) in RESIDENT_TIERS


class WorkerDiscovery(models.Model):
    """One name of settings.INFERENCE_DISCOVERY and what its last lookup found (the fleet page
    shows it: a name that stops resolving is an operator's problem to see, not a silent gap)."""

    spec = models.CharField(max_length=300, unique=True)  # "dns://inference-headless:8001"
    addresses = models.JSONField(default=list, blank=True)  # worker URLs of the last good answer
    last_error = models.TextField(blank=True)  # why the last lookup found nothing ("" = it worked)
    resolved_at = models.DateTimeField(null=True, blank=True)  # last lookup, good or not
    last_ok_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["spec"]
        verbose_name = "worker discovery name"

    def __str__(self) -> str:
        return self.spec


# -- history: what each poll saw, kept over time (portal.fleet.history folds and prunes it) -----

# The memory gauges a worker reports (loraplex:memory_bytes{kind}) that history keeps; a worker's
# other memory gauges (process RSS, ...) are shown live only.
MEMORY_KINDS = ("base_weights", "kv_cache", "adapter_slots", "host_adapters")
# Adapter tiers counted per sample: in memory (device slots, host), on their way (loading),
# registered but evicted (disk) and broken (failed).
SAMPLE_TIERS = ("device", "host", "loading", "disk", "failed")
# Gauges: a raw sample holds the polled value in both columns; a folded row the mean over the
# healthy polls it folds (weighted by `samples` when minutes fold into hours) and the max.
GAUGES = ("num_running", "num_waiting", "kv_cache_usage", *(f"adapters_{t}" for t in SAMPLE_TIERS),
          *(f"memory_{k}" for k in MEMORY_KINDS))
# Cumulative counters since the worker started (cache_stats): a folded row keeps the last value;
# rates come from differences between consecutive rows (a drop is a restart).
COUNTERS = ("loads", "load_failures", "misses", "hits_device", "hits_host", "evictions_device", "evictions_host")


class Resolution(models.TextChoices):
    RAW = "raw", "every poll"
    MINUTE = "minute", "1 minute"
    HOUR = "hour", "1 hour"


def _gauge_fields() -> dict:
    fields = {}
    for name in GAUGES:
        fields[name] = models.FloatField(null=True, blank=True)
        fields[f"{name}_max"] = models.FloatField(null=True, blank=True)
    return fields


def _counter_fields() -> dict:
    return {name: models.BigIntegerField(null=True, blank=True) for name in COUNTERS}


class WorkerSample(models.Model):
    """One worker at one poll (resolution raw), or one worker's polls over a minute or an hour
    folded into one row (`at` = the bucket's start). One table for all three resolutions: the
    history selector reads them with one query (a folded row is a raw row with `samples` > 1),
    and on PostgreSQL a fold is one INSERT ... SELECT within it. Gauges and counters are NULL
    where nothing is known: a poll that found the worker unhealthy, or a bucket with no healthy
    poll."""

    # Not a constraint: a discovered pod's row is deleted an hour after it left
    # (services.FORGET_GONE_AFTER); its history stays, and ids are never reused.
    worker = models.ForeignKey(InferenceWorker, on_delete=models.DO_NOTHING, db_constraint=False,
                               related_name="+")
    at = models.DateTimeField()
    resolution = models.CharField(max_length=6, choices=Resolution.choices, default=Resolution.RAW)
    polls = models.PositiveIntegerField(default=1)  # polls folded in (1 for raw)
    samples = models.PositiveIntegerField(default=1)  # of which healthy: the weight of the means
    healthy = models.BooleanField()  # raw: the poll's; folded: any healthy poll in the bucket
    state = models.CharField(max_length=12)  # InferenceWorker.state at the (last) poll
    locals().update(_gauge_fields())
    locals().update(_counter_fields())

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["worker", "resolution", "at"], name="fleet_sample_one_per_bucket",
                                    condition=~models.Q(resolution="raw")),
        ]
        indexes = [models.Index(fields=["resolution", "at"], name="fleet_sample_res_at")]

    def __str__(self) -> str:
        return f"worker {self.worker_id} at {self.at:%Y-%m-%d %H:%M:%S} ({self.resolution})"


class WorkerEvent(models.Model):
    """A change of a worker's state, written when it happens (not every poll): the annotations
    on the history charts."""

    class Kind(models.TextChoices):
        HEALTHY = "healthy", "became healthy"
        UNHEALTHY = "unhealthy", "became unhealthy"
        DRAINING = "draining", "draining (shutting down)"
        MISMATCHED = "mismatched", "serves another base model"
        GONE = "gone", "left its discovery name"
        BACK = "back", "listed by its discovery name again"

    worker = models.ForeignKey(InferenceWorker, on_delete=models.DO_NOTHING, db_constraint=False,
                               related_name="+")
    worker_name = models.CharField(max_length=100)  # the name then (the row may be gone since)
    at = models.DateTimeField()
    kind = models.CharField(max_length=12, choices=Kind.choices)
    detail = models.TextField(blank=True)  # last_error, or the base model a healthy worker serves

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["at"], name="fleet_event_at"),
                   models.Index(fields=["worker", "at"], name="fleet_event_worker_at")]

    def __str__(self) -> str:
        return f"{self.worker_name} {self.kind} at {self.at:%Y-%m-%d %H:%M:%S}"

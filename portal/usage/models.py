"""The usage ledger and its daily rollups.

    UsageRecord   one row per API request (keyed by the gateway's x-request-id), written once
                  when the request ends, however it ends; the system of record for billing
    DailyUsage    per (UTC day, tenant, public model id): counts, token sums and latency
                  percentiles, rebuilt from the ledger by usage_rollup_day (Celery, hourly);
                  the console's usage pages and statements read it
    UsageRollup   per (minute | hour | day, dashboard filter value): counts and exact latency
                  percentiles, for the staff dashboards (portal.usage.rollups, every minute);
    UsageErrorRollup  the same buckets' errors by tenant, status and code
    RollupWatermark   how far each granularity has read the ledger (by recorded_at)

Days and months are UTC days and months of `created_at` (when the request started).
"""

from __future__ import annotations

from django.db import models
from django.utils import timezone

from portal.adapters.models import AdapterVersion
from portal.keys.models import ApiKey
from portal.tenants.models import Tenant

REQUEST_ID_MAX_LENGTH = 200
MODEL_MAX_LENGTH = 200
WORKER_URL_MAX_LENGTH = 500
FINISH_REASON_MAX_LENGTH = 32
ERROR_CODE_MAX_LENGTH = 64


class UsageRecord(models.Model):
    class Constrained(models.TextChoices):
        """What shaped the answer beyond sampling (set by the gateway from the request body)."""

        NONE = "", "none"
        JSON_OBJECT = "json_object", "JSON object"
        JSON_SCHEMA = "json_schema", "JSON schema"
        TOOLS = "tools", "tool call"

    class AdapterTier(models.TextChoices):
        """Where the worker found the request's adapter when the request arrived (the worker says)."""

        NONE = "", "base model or not reported"
        DEVICE = "device", "in a device slot (warm)"
        HOST = "host", "in host memory, copied into a slot for it"
        DISK = "disk", "read from disk or fetched for it"

    # The gateway's x-request-id; unique, which is what makes the write exactly-once.
    request_id = models.CharField(max_length=REQUEST_ID_MAX_LENGTH, unique=True)
    # The completion's "id" as the client saw it (chatcmpl-..., cmpl-...; "" when no answer
    # began): how feedback on a completion finds the version that served it.
    completion_id = models.CharField(max_length=REQUEST_ID_MAX_LENGTH, blank=True, db_index=True)
    # PROTECT: the ledger is what the tenant is billed from; it outlives nothing by accident.
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="usage_records")
    api_key = models.ForeignKey(
        ApiKey, on_delete=models.SET_NULL, null=True, blank=True, related_name="usage_records"
    )
    model = models.CharField(max_length=MODEL_MAX_LENGTH, help_text="The model id as the client asked.")
    adapter_version = models.ForeignKey(
        AdapterVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="usage_records"
    )
    worker_url = models.CharField(max_length=WORKER_URL_MAX_LENGTH, blank=True)
    stream = models.BooleanField(default=False)
    prompt_tokens = models.PositiveIntegerField(default=0)  # as the worker counted them
    completion_tokens = models.PositiveIntegerField(default=0)
    # Of prompt_tokens, those the worker found in its prefix cache (its
    # usage.prompt_tokens_details.cached_tokens): not computed again, the basis of a cheaper rate.
    cached_prompt_tokens = models.PositiveIntegerField(default=0)
    # The request asked for structured output (response_format json_object / json_schema) or a
    # forced tool call: its tokens were masked by a grammar, which costs the worker more per token.
    constrained = models.CharField(max_length=16, choices=Constrained.choices, default=Constrained.NONE,
                                   blank=True)
    # Cold start: an adapter not in a device slot when its request arrived (host or disk) was
    # loaded for it; the seeds' key figure is that request's extra time to first token.
    adapter_tier = models.CharField(max_length=8, choices=AdapterTier.choices, default=AdapterTier.NONE,
                                    blank=True)
    time_to_first_token_ms = models.FloatField(null=True, blank=True)
    # Mean gap between output tokens after the first (None with fewer than two tokens).
    inter_token_ms = models.FloatField(null=True, blank=True)
    # The worker engine's queue time: arrival to first scheduled (None when it never ran).
    queue_ms = models.FloatField(null=True, blank=True)
    latency_ms = models.FloatField(default=0.0)
    finish_reason = models.CharField(max_length=FINISH_REASON_MAX_LENGTH, blank=True)
    error = models.TextField(blank=True)
    # The OpenAI error code (or type, when it has no code) the client was answered with, or
    # that ended its stream; "" without an error. Tells a 429 rate limit from a spent budget.
    error_code = models.CharField(max_length=ERROR_CODE_MAX_LENGTH, blank=True)
    status_code = models.PositiveSmallIntegerField(default=200)
    client_disconnected = models.BooleanField(default=False)
    # Workers the gateway sent the request to: 0 = none (refused before routing), > 1 = retried.
    upstream_attempts = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(default=timezone.now, help_text="When the request started.")
    finished_at = models.DateTimeField(default=timezone.now)
    # When the row was written: a row may land long after created_at (a long stream, the spool
    # replaying after a database outage); roll-ups recompute the buckets such rows fall in.
    recorded_at = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["tenant", "created_at"], name="usage_record_tenant_created"),
            models.Index(fields=["created_at"], name="usage_record_created"),
            models.Index(fields=["recorded_at"], name="usage_record_recorded"),
            # Error dashboards read only these rows (a few percent of the ledger).
            models.Index(fields=["created_at"], name="usage_record_errors",
                         condition=models.Q(status_code__gte=400) | ~models.Q(error="")),
        ]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} ({self.prompt_tokens}+{self.completion_tokens} tokens)"

    @property
    def is_error(self) -> bool:
        return is_error(status_code=self.status_code, error=self.error)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def is_error(*, status_code: int, error: str) -> bool:
    """A request counts as an error when it ended with a 4xx/5xx status or an error message."""
    return status_code >= 400 or bool(error)


# The same two definitions as filters on UsageRecord. "Completed" requests are the ones whose
# timings say something about the service: no error and the client stayed to the end.
ERROR_Q = models.Q(status_code__gte=400) | ~models.Q(error="")
COMPLETED_Q = models.Q(status_code__lt=400, error="", client_disconnected=False)


class DailyUsage(models.Model):
    """One UTC day of one tenant's use of one public model id; rebuilt from the ledger."""

    date = models.DateField()
    tenant = models.ForeignKey(Tenant, on_delete=models.PROTECT, related_name="daily_usage")
    model = models.CharField(max_length=MODEL_MAX_LENGTH)
    # The version that served the day's requests when they all agree; None for the base model
    # or when a deployment split the day between versions.
    adapter_version = models.ForeignKey(
        AdapterVersion, on_delete=models.SET_NULL, null=True, blank=True, related_name="+"
    )
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    disconnects = models.PositiveIntegerField(default=0)
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # Percentiles over the day's completed requests (no error, no client disconnect), in ms;
    # None when there were none. Percentiles do not add up across days: ask the ledger
    # (selectors.latency_percentiles) for a longer period.
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    ttft_p99_ms = models.FloatField(null=True, blank=True)
    latency_p50_ms = models.FloatField(null=True, blank=True)
    latency_p95_ms = models.FloatField(null=True, blank=True)
    latency_p99_ms = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-date", "tenant__slug", "model"]
        verbose_name_plural = "daily usage"
        constraints = [
            models.UniqueConstraint(fields=["date", "tenant", "model"], name="daily_usage_unique_day_tenant_model"),
        ]
        indexes = [models.Index(fields=["tenant", "date"], name="daily_usage_tenant_date")]

    def __str__(self) -> str:
        return f"{self.date} {self.tenant_id} {self.model}"

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class UsageRollup(models.Model):
    """One bucket (a UTC minute, hour or day) of the ledger for one dashboard filter value.

    Percentiles do not add up across buckets or groups, so each row holds EXACT percentiles
    (PostgreSQL percentile_cont over the bucket's ledger rows of that group), rebuilt by
    portal.usage.rollups; a dashboard reads one row per bucket. Counts do add up (a 6-hour
    bucket's requests are the sum of its hour rows). Percentiles are over completed requests
    (COMPLETED_Q); None when the bucket has none with that timing.
    """

    class Granularity(models.TextChoices):
        MINUTE = "minute", "minute"
        HOUR = "hour", "hour"
        DAY = "day", "day"

    class Dimension(models.TextChoices):
        ALL = "all", "all requests"  # key ""
        TENANT = "tenant", "tenant"  # key: the tenant id
        MODEL = "model", "model id"  # key: the model id as the client asked
        VERSION = "version", "adapter version"  # key: the version id; "" for the base model
        WORKER = "worker", "inference worker"  # key: the worker url; "" when never routed

    granularity = models.CharField(max_length=8, choices=Granularity.choices)
    bucket = models.DateTimeField(help_text="Start of the bucket (UTC, aligned like date_bin on the Unix epoch).")
    dimension = models.CharField(max_length=8, choices=Dimension.choices)
    key = models.CharField(max_length=WORKER_URL_MAX_LENGTH, blank=True)
    requests = models.PositiveIntegerField(default=0)
    completed = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    cold_requests = models.PositiveIntegerField(default=0)  # adapter_tier host or disk
    retried = models.PositiveIntegerField(default=0)  # upstream_attempts > 1
    # Requests that used tokens: those a statement bills (portal.usage.billing), so the billing
    # dashboard sums these instead of the month's ledger.
    billed = models.PositiveIntegerField(default=0)
    disconnects = models.PositiveIntegerField(default=0)  # client_disconnected
    prompt_tokens = models.PositiveBigIntegerField(default=0)
    completion_tokens = models.PositiveBigIntegerField(default=0)
    # Completed requests with a TTFT, and those of them within their tenant's TTFT target as it
    # was when the bucket was rolled up: the SLO share is slo_met / ttft_requests (adds up).
    ttft_requests = models.PositiveIntegerField(default=0)
    slo_met = models.PositiveIntegerField(default=0)
    ttft_p50_ms = models.FloatField(null=True, blank=True)
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    ttft_p99_ms = models.FloatField(null=True, blank=True)
    # TTFT split by where the adapter was: warm = device slot or base model, cold = host or disk.
    ttft_warm_p50_ms = models.FloatField(null=True, blank=True)
    ttft_warm_p95_ms = models.FloatField(null=True, blank=True)
    ttft_warm_p99_ms = models.FloatField(null=True, blank=True)
    ttft_cold_p50_ms = models.FloatField(null=True, blank=True)
    ttft_cold_p95_ms = models.FloatField(null=True, blank=True)
    ttft_cold_p99_ms = models.FloatField(null=True, blank=True)
    itl_p50_ms = models.FloatField(null=True, blank=True)
    itl_p95_ms = models.FloatField(null=True, blank=True)
    itl_p99_ms = models.FloatField(null=True, blank=True)
    latency_p50_ms = models.FloatField(null=True, blank=True)
    latency_p95_ms = models.FloatField(null=True, blank=True)
    latency_p99_ms = models.FloatField(null=True, blank=True)
    queue_p50_ms = models.FloatField(null=True, blank=True)
    queue_p95_ms = models.FloatField(null=True, blank=True)
    queue_p99_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["granularity", "dimension", "key", "bucket"]
        constraints = [
            # Also the index every dashboard read uses: (granularity, dimension, key, bucket range).
            models.UniqueConstraint(fields=["granularity", "dimension", "key", "bucket"],
                                    name="usage_rollup_unique_bucket"),
        ]
        indexes = [models.Index(fields=["granularity", "bucket"], name="usage_rollup_bucket")]

    def __str__(self) -> str:
        return f"{self.granularity} {self.bucket.isoformat()} {self.dimension}={self.key}"


class RollupWatermark(models.Model):
    """How far the roll-ups of one granularity have read the ledger.

    recorded_until: the newest UsageRecord.recorded_at the last run saw; the next run recomputes
    the buckets of rows recorded after it (less a grace for rows still committing).
    covered_until: when the last run ran; the bucket holding that moment and later ones are read
    from the ledger at query time.
    """

    granularity = models.CharField(max_length=8, choices=UsageRollup.Granularity.choices, unique=True)
    recorded_until = models.DateTimeField(null=True, blank=True)
    covered_until = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.granularity} rolled up to {self.covered_until}"


class UsageErrorRollup(models.Model):
    """Error rows of one bucket by tenant, status and error code (counts add up across buckets):
    the errors dashboard over long ranges without reading tens of thousands of ledger rows.
    Rebuilt with UsageRollup, bucket for bucket, in the same transaction."""

    granularity = models.CharField(max_length=8, choices=UsageRollup.Granularity.choices)
    bucket = models.DateTimeField()
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="+")
    status_code = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=ERROR_CODE_MAX_LENGTH, blank=True)
    count = models.PositiveIntegerField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["granularity", "bucket", "tenant", "status_code", "error_code"],
                                    name="usage_error_rollup_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.granularity} {self.bucket.isoformat()} {self.tenant_id} {self.status_code} {self.error_code}"

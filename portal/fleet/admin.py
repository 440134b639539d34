from django.contrib import admin, messages
from django.utils.html import format_html_join

from portal.fleet.models import RESIDENT_TIERS, InferenceWorker
from portal.fleet.services import fleet_sync_from_settings, worker_poll

POLL_FIELDS = [
    "healthy",
    "base_model",
    "last_polled_at",
    "last_seen_at",
    "last_error",
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "resident_adapters",
    "memory",
    "cache_stats",
    "created_at",
    "updated_at",
]


@admin.register(InferenceWorker)
class InferenceWorkerAdmin(admin.ModelAdmin):
    list_display = [
        "__str__",
        "url",
        "enabled",
        "healthy",
        "load_display",
        "kv_cache_display",
        "adapters_display",
        "base_model",
        "last_seen_at",
        "last_error",
    ]
    list_filter = ["enabled", "healthy"]
    search_fields = ["url", "name", "base_model"]
    fields = ["url", "name", "enabled", *POLL_FIELDS]
    readonly_fields = POLL_FIELDS
    actions = ["poll_now", "enable", "disable", "sync_from_settings"]

    @admin.display(description="load (running + waiting)")
    def load_display(self, worker: InferenceWorker) -> str:
        return f"{worker.load} ({worker.num_running} + {worker.num_waiting})"

    @admin.display(description="KV cache")
    def kv_cache_display(self, worker: InferenceWorker) -> str:
        return f"{worker.kv_cache_usage:.0%}"

    @admin.display(description="resident adapters")
    def adapters_display(self, worker: InferenceWorker) -> str:
        resident = sorted((name, tier) for name, tier in (worker.resident_adapters or {}).items()
                          if tier in RESIDENT_TIERS)
        if not resident:
            return "-"
        return format_html_join(", ", "{} ({})", resident)

    @admin.action(description="Poll selected workers now")
    def poll_now(self, request, queryset):
        workers = [worker_poll(worker=worker) for worker in queryset]
        healthy = sum(w.healthy for w in workers)
        level = messages.SUCCESS if healthy == len(workers) else messages.WARNING
        self.message_user(request, f"Polled {len(workers)} worker(s): {healthy} healthy.", level)

    @admin.action(description="Enable selected workers")
    def enable(self, request, queryset):
        count = queryset.update(enabled=True)
        self.message_user(request, f"Enabled {count} worker(s).", messages.SUCCESS)

    @admin.action(description="Disable selected workers (no traffic, not polled)")
    def disable(self, request, queryset):
        count = queryset.update(enabled=False)
        self.message_user(request, f"Disabled {count} worker(s).", messages.SUCCESS)

    @admin.action(description="Add the workers listed in INFERENCE_URLS")
    def sync_from_settings(self, request, queryset):
        workers = fleet_sync_from_settings()
        self.message_user(request, f"{len(workers)} worker(s) from INFERENCE_URLS are registered.", messages.SUCCESS)

"""The ledger in the admin: read-only (it is what tenants are billed from)."""

from django.contrib import admin

from portal.usage.models import DailyUsage, UsageRecord


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(UsageRecord)
class UsageRecordAdmin(ReadOnlyAdmin):
    list_display = (
        "created_at",
        "tenant",
        "model",
        "prompt_tokens",
        "completion_tokens",
        "cached_prompt_tokens",
        "constrained",
        "time_to_first_token_ms",
        "latency_ms",
        "status_code",
        "finish_reason",
        "client_disconnected",
        "request_id",
    )
    list_filter = ("tenant", "model", ("created_at", admin.DateFieldListFilter), "status_code", "client_disconnected", "stream",
                   "constrained")
    search_fields = ("request_id", "model", "tenant__slug", "error")
    date_hierarchy = "created_at"
    list_select_related = ("tenant",)
    show_full_result_count = False  # no COUNT(*) over the whole ledger on every page


@admin.register(DailyUsage)
class DailyUsageAdmin(ReadOnlyAdmin):
    list_display = (
        "date",
        "tenant",
        "model",
        "requests",
        "errors",
        "disconnects",
        "prompt_tokens",
        "completion_tokens",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "latency_p50_ms",
        "latency_p99_ms",
    )
    list_filter = ("tenant", "model", ("date", admin.DateFieldListFilter))
    search_fields = ("model", "tenant__slug")
    date_hierarchy = "date"
    list_select_related = ("tenant",)

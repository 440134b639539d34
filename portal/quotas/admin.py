from django.contrib import admin

from portal.quotas.models import Quota


@admin.register(Quota)
class QuotaAdmin(admin.ModelAdmin):
    list_display = [
        "owner_label",
        "requests_per_minute",
        "tokens_per_minute",
        "max_concurrent_requests",
        "monthly_token_budget",
        "monthly_spend_limit",
        "updated_at",
    ]
    list_select_related = ["tenant", "api_key__tenant"]
    search_fields = ["tenant__slug", "api_key__name", "api_key__prefix", "api_key__tenant__slug"]
    raw_id_fields = ["tenant", "api_key"]
    fieldsets = [
        ("For", {"fields": ["tenant", "api_key"], "description": "Exactly one of the two."}),
        (
            "Limits",
            {
                "fields": [
                    "requests_per_minute",
                    "tokens_per_minute",
                    "max_concurrent_requests",
                    "monthly_token_budget",
                    "monthly_spend_limit",
                ],
                "description": "Empty: a tenant's row falls back to its plan's limit; "
                "a key's row puts no key-level limit (the tenant's still apply). "
                "The spend limit is in USD a month, priced like the statement.",
            },
        ),
    ]

    @admin.display(description="for")
    def owner_label(self, obj: Quota) -> str:
        return obj.owner_label

from django.contrib import admin, messages

from portal.tenants.models import Membership, Tenant
from portal.tenants.services import tenant_activate, tenant_suspend


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 0
    autocomplete_fields = ["user"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "plan", "status", "created_at"]
    list_filter = ["plan", "status"]
    search_fields = ["slug", "name"]
    readonly_fields = ["created_at"]
    inlines = [MembershipInline]
    actions = ["suspend", "activate"]

    @admin.action(description="Suspend selected tenants (their API calls get 403)")
    def suspend(self, request, queryset):
        for tenant in queryset:
            tenant_suspend(tenant=tenant)
        self.message_user(request, f"Suspended {len(queryset)} tenant(s).", messages.SUCCESS)

    @admin.action(description="Reactivate selected tenants")
    def activate(self, request, queryset):
        for tenant in queryset:
            tenant_activate(tenant=tenant)
        self.message_user(request, f"Reactivated {len(queryset)} tenant(s).", messages.SUCCESS)


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "tenant", "role", "created_at"]
    list_filter = ["role"]
    search_fields = ["user__username", "tenant__slug"]
    autocomplete_fields = ["user", "tenant"]

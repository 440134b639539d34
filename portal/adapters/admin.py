from django.contrib import admin

from portal.adapters.models import Adapter, AdapterVersion


class AdapterVersionInline(admin.TabularInline):
    model = AdapterVersion
    extra = 0
    fields = ("number", "status", "source_path", "rank", "sha256", "uid", "created_at")
    readonly_fields = ("uid", "created_at")


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ("__str__", "tenant", "base_model", "created_at")
    list_filter = ("tenant",)
    search_fields = ("name", "tenant__slug")
    inlines = [AdapterVersionInline]


@admin.register(AdapterVersion)
class AdapterVersionAdmin(admin.ModelAdmin):
    list_display = ("__str__", "status", "rank", "source_path", "created_at")
    list_filter = ("status", "adapter__tenant")
    search_fields = ("adapter__name", "adapter__tenant__slug", "uid")
    readonly_fields = ("uid", "created_at", "updated_at")

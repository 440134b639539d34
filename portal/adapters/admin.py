from django.contrib import admin

from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment


class AdapterVersionInline(admin.TabularInline):
    """Shown, never edited: see AdapterVersionAdmin."""

    model = AdapterVersion
    extra = 0
    fields = ("number", "status", "source_path", "storage_dir", "rank", "sha256", "uid", "created_at")
    readonly_fields = fields

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class DeploymentInline(admin.StackedInline):
    model = Deployment
    extra = 0
    fields = ("weights", "always_warm", "updated_by", "updated_at")
    readonly_fields = ("updated_by", "updated_at")


@admin.register(Adapter)
class AdapterAdmin(admin.ModelAdmin):
    list_display = ("__str__", "tenant", "base_model", "created_at")
    list_filter = ("tenant",)
    search_fields = ("name", "tenant__slug")
    inlines = [DeploymentInline, AdapterVersionInline]


@admin.register(AdapterVersion)
class AdapterVersionAdmin(admin.ModelAdmin):
    """Read-only: a version's status and what validation found about its files change only
    through the services (upload -> validate -> stage, deployments, retire). A hand edit could
    mark a version that was never validated ready, and an added one would start out ready."""

    list_display = ("__str__", "status", "rank", "size_bytes", "base_model", "source_path", "created_at")
    list_filter = ("status", "adapter__tenant")
    search_fields = ("adapter__name", "adapter__tenant__slug", "uid", "sha256")
    readonly_fields = (
        "uid",
        "storage_dir",
        "file_sha256",
        "rejection_reasons",
        "validated_at",
        "retired_at",
        "staging",
        "created_at",
        "updated_at",
    )

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Deployment)
class DeploymentAdmin(admin.ModelAdmin):
    list_display = ("adapter", "weights", "always_warm", "updated_by", "updated_at")
    list_filter = ("always_warm", "adapter__tenant")
    search_fields = ("adapter__name", "adapter__tenant__slug")
    readonly_fields = ("updated_by", "updated_at")


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    """Read-only: the trail is written by the services, never edited by hand."""

    list_display = ("created_at", "tenant", "actor", "action", "target")
    list_filter = ("action", "tenant")
    search_fields = ("target", "tenant__slug", "actor__username")
    readonly_fields = ("tenant", "actor", "action", "target", "details", "created_at")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

from django import forms
from django.contrib import admin, messages
from django.utils import timezone

from portal.core.exceptions import InvalidInput
from portal.keys.models import ApiKey
from portal.keys.services import api_key_create, api_key_revoke, validate_allowed_models


class ApiKeyAdminForm(forms.ModelForm):
    class Meta:
        model = ApiKey
        fields = ["tenant", "name", "expires_at", "allowed_models"]

    def clean_expires_at(self):
        expires_at = self.cleaned_data["expires_at"]
        if self.instance.pk is None and expires_at is not None and expires_at <= timezone.now():
            raise forms.ValidationError("A new key must expire in the future.")
        return expires_at

    def clean_allowed_models(self):
        allowed_models = self.cleaned_data["allowed_models"]
        try:
            validate_allowed_models(allowed_models)
        except InvalidInput as error:
            raise forms.ValidationError(error.message) from None
        return allowed_models


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    form = ApiKeyAdminForm
    list_display = [
        "name",
        "tenant",
        "display_prefix",
        "created_at",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    list_filter = ["tenant"]
    search_fields = ["name", "prefix", "tenant__slug"]
    readonly_fields = ["display_prefix", "created_by", "created_at", "revoked_at", "last_used_at", "rotated_at",
                       "previous_valid_until"]
    actions = ["revoke"]

    def get_readonly_fields(self, request, obj=None):
        # A key never moves to another tenant.
        return [*self.readonly_fields, "tenant"] if obj else self.readonly_fields

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        api_key, plaintext = api_key_create(
            tenant=obj.tenant,
            name=obj.name,
            created_by=request.user,
            expires_at=obj.expires_at,
            allowed_models=obj.allowed_models,
        )
        # The admin goes on to log and redirect to `obj`; make it the created key.
        for field in ApiKey._meta.concrete_fields:
            setattr(obj, field.attname, getattr(api_key, field.attname))
        self.message_user(
            request,
            f"Copy this API key now; it will not be shown again: {plaintext}",
            messages.WARNING,
        )

    @admin.action(description="Revoke selected keys (for good)")
    def revoke(self, request, queryset):
        for api_key in queryset:
            api_key_revoke(api_key=api_key)
        self.message_user(request, f"Revoked {len(queryset)} key(s).", messages.SUCCESS)

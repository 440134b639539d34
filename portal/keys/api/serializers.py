"""Request and response shapes of the keys REST API (validation at the edge only; the services
own the rules). Money is a decimal string in the plan's currency (USD), never a float."""

from __future__ import annotations

from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.keys.models import ApiKey
from portal.keys.services import DEFAULT_ROTATION_GRACE, MAX_ROTATION_GRACE
from portal.quotas.models import LIMIT_FIELDS, SPEND_DECIMAL_PLACES
from portal.tenants.plans import CURRENCY


class KeyLimitsSerializer(serializers.Serializer):
    """The key's own limits (null: no key-level limit; the tenant's limits still apply)."""

    requests_per_minute = serializers.IntegerField(min_value=0, allow_null=True, required=False)
    tokens_per_minute = serializers.IntegerField(min_value=0, allow_null=True, required=False)
    max_concurrent_requests = serializers.IntegerField(min_value=0, allow_null=True, required=False)
    monthly_token_budget = serializers.IntegerField(
        min_value=0, allow_null=True, required=False, help_text="Tokens a UTC calendar month."
    )
    monthly_spend_limit = serializers.DecimalField(
        max_digits=18, decimal_places=SPEND_DECIMAL_PLACES, min_value=0, allow_null=True, required=False,
        coerce_to_string=True,
        help_text=f"{CURRENCY} a UTC calendar month, priced like the monthly statement (a decimal string, e.g. \"25.00\").",
    )


class ApiKeySerializer(serializers.ModelSerializer):
    """A key as listed: never its secret."""

    display_prefix = serializers.CharField(read_only=True, help_text="The secret's first characters, to tell keys apart.")
    status = serializers.SerializerMethodField()
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)
    limits = serializers.SerializerMethodField()
    currency = serializers.SerializerMethodField()
    previous_secret_valid_until = serializers.SerializerMethodField()

    class Meta:
        model = ApiKey
        fields = [
            "id", "name", "display_prefix", "status", "allowed_models", "expires_at", "created_at", "created_by",
            "last_used_at", "revoked_at", "rotated_at", "previous_secret_valid_until", "limits", "currency",
        ]  # fmt: skip
        read_only_fields = fields

    @extend_schema_field({"type": "string", "enum": ["active", "expired", "revoked"]})
    def get_status(self, key: ApiKey) -> str:
        if key.revoked_at is not None:
            return "revoked"
        return "active" if key.is_usable() else "expired"

    @extend_schema_field(KeyLimitsSerializer)
    def get_limits(self, key: ApiKey) -> dict:
        quota = getattr(key, "quota", None)
        return KeyLimitsSerializer({name: getattr(quota, name, None) for name in LIMIT_FIELDS}).data

    def get_currency(self, key: ApiKey) -> str:
        return CURRENCY

    @extend_schema_field(serializers.DateTimeField(allow_null=True))
    def get_previous_secret_valid_until(self, key: ApiKey):
        """Until when the secret replaced by the last rotation still works (null: it does not)."""
        until = key.previous_valid_until
        if until is None or until <= timezone.now():
            return None
        return serializers.DateTimeField().to_representation(until)


class ApiKeyCreatedSerializer(ApiKeySerializer):
    key = serializers.CharField(read_only=True, help_text="The secret: shown in this response only, never again.")

    class Meta(ApiKeySerializer.Meta):
        fields = ["key", *ApiKeySerializer.Meta.fields]
        read_only_fields = fields


class ApiKeyCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=100)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, help_text="Omit or null: never expires.")
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, allow_null=True, allow_empty=False,
        help_text='Public model ids the key may use ("acme/bot" allows all its versions); omit or null: any model.',
    )
    limits = KeyLimitsSerializer(required=False, help_text="The key's own limits; omitted ones are no key-level limit.")


class ApiKeyUpdateSerializer(serializers.Serializer):
    """What PATCH may change; fields left out stay as they are."""

    name = serializers.CharField(max_length=100, required=False)
    expires_at = serializers.DateTimeField(required=False, allow_null=True, help_text="null: never expires.")
    allowed_models = serializers.ListField(
        child=serializers.CharField(max_length=200), required=False, allow_null=True, allow_empty=False,
        help_text="null: any model.",
    )
    limits = KeyLimitsSerializer(
        required=False, help_text="Limits given replace the key's (null: no key-level limit); others stay."
    )

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError("send name, expires_at, allowed_models and/or limits")
        return attrs


class ApiKeyRotateSerializer(serializers.Serializer):
    grace_period_seconds = serializers.IntegerField(
        min_value=0, max_value=int(MAX_ROTATION_GRACE.total_seconds()),
        default=int(DEFAULT_ROTATION_GRACE.total_seconds()),
        help_text="How long the replaced secret keeps working (default 24 h, at most 7 days; 0: not at all).",
    )

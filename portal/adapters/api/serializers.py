"""Request and response shapes of the adapters REST API (validation at the edge only; the
services own the rules)."""

from __future__ import annotations

import re

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from portal.adapters.models import Adapter, AdapterVersion, AuditEvent, Deployment


class DeploymentSerializer(serializers.ModelSerializer):
    weights = serializers.DictField(
        child=serializers.IntegerField(min_value=0),
        help_text='Weights over version numbers, e.g. {"3": 90, "4": 10}; {} = the newest ready version.',
    )
    updated_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = Deployment
        fields = ["weights", "always_warm", "require_evaluation", "evaluation_min_pass_rate", "updated_by", "updated_at"]
        read_only_fields = fields


class DeploymentUpdateSerializer(serializers.Serializer):
    weights = serializers.DictField(
        child=serializers.IntegerField(min_value=0, max_value=1_000_000),
        required=False,
        help_text='{"<version number>": weight} ("v3" works too); {} routes to the newest ready version.',
    )
    always_warm = serializers.BooleanField(required=False)
    require_evaluation = serializers.BooleanField(
        required=False, help_text="A version gets traffic only once its latest completed evaluation run passed.")
    evaluation_min_pass_rate = serializers.FloatField(
        required=False, allow_null=True, min_value=0.0, max_value=1.0,
        help_text="The pass rate (0..1) an evaluation must reach; null: at least the serving version's.")

    def validate_weights(self, value: dict) -> dict[int, int]:
        weights = {}
        for key, weight in value.items():
            m = re.fullmatch(r"v?([1-9][0-9]{0,8})", str(key).strip())
            if m is None:
                raise serializers.ValidationError(f"{key!r} is not a version number (e.g. \"3\" or \"v3\")")
            number = int(m[1])
            if number in weights:
                raise serializers.ValidationError(f"version {number} is listed twice")
            weights[number] = weight
        return weights

    def validate(self, attrs):
        if not attrs:
            raise serializers.ValidationError("send weights, always_warm, require_evaluation and/or evaluation_min_pass_rate")
        return attrs


class VersionSerializer(serializers.ModelSerializer):
    public_id = serializers.CharField(read_only=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = AdapterVersion
        fields = [
            "number", "public_id", "uid", "status", "rejection_reasons", "sha256", "file_sha256", "size_bytes",
            "rank", "alpha", "target_modules", "base_model", "staging", "created_by", "created_at",
            "validated_at", "retired_at",
        ]  # fmt: skip
        read_only_fields = fields


class VersionStatusSerializer(serializers.ModelSerializer):
    class Meta:
        model = AdapterVersion
        fields = ["number", "status", "rejection_reasons", "staging", "validated_at", "retired_at"]
        read_only_fields = fields


class VersionUploadSerializer(serializers.Serializer):
    """For the schema: the multipart body of an upload (the view reads request.FILES itself)."""

    files = serializers.ListField(
        child=serializers.FileField(),
        help_text=(
            "The files PeftModel.save_pretrained wrote (adapter_config.json and adapter_model.safetensors; a "
            "README.md model card, tokenizer and other text files are accepted and ignored, pickles such as "
            "training_args.bin refused), or one .zip/.tar.gz of the adapter directory."
        ),
    )


class AdapterSerializer(serializers.ModelSerializer):
    public_id = serializers.CharField(read_only=True)
    latest_ready_version = serializers.SerializerMethodField()
    deployment = serializers.SerializerMethodField()

    class Meta:
        model = Adapter
        fields = [
            "name", "public_id", "description", "base_model", "latest_ready_version", "deployment", "created_at",
            "updated_at",
        ]  # fmt: skip
        read_only_fields = fields

    def get_latest_ready_version(self, adapter: Adapter) -> int | None:
        return (
            adapter.versions.filter(status=AdapterVersion.Status.READY).order_by("-number")
            .values_list("number", flat=True).first()
        )

    @extend_schema_field(DeploymentSerializer(allow_null=True))
    def get_deployment(self, adapter: Adapter) -> dict | None:
        deployment = Deployment.objects.filter(adapter=adapter).first()
        return DeploymentSerializer(deployment).data if deployment else None


class AdapterCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=64, help_text="Lowercase letters, digits, '.', '_', '-' (the model id's second half).")
    description = serializers.CharField(max_length=10_000, required=False, allow_blank=True, default="")
    base_model = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")


class AdapterUpdateSerializer(serializers.Serializer):
    description = serializers.CharField(max_length=10_000, required=False, allow_blank=True)
    base_model = serializers.CharField(max_length=200, required=False, allow_blank=True)

    def validate(self, attrs):
        unknown = sorted(set(self.initial_data) - set(self.fields))
        if "name" in unknown:
            raise serializers.ValidationError(
                {"name": "An adapter's name cannot be changed (it is part of its model id); create a new adapter."}
            )
        if unknown:
            raise serializers.ValidationError(f"Unknown fields: {', '.join(unknown)}.")
        return attrs


class AuditEventSerializer(serializers.ModelSerializer):
    actor = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = AuditEvent
        fields = ["created_at", "actor", "action", "target", "details"]
        read_only_fields = fields

"""Request and response shapes of the evaluation API (the services own the rules)."""

from __future__ import annotations

from rest_framework import serializers

from portal.evals.models import EvaluationResult, EvaluationRun, EvaluationSet


class EvaluationSetSerializer(serializers.ModelSerializer):
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = EvaluationSet
        fields = ["id", "case_count", "checked_count", "filename", "size_bytes", "sha256", "created_by", "created_at",
                  "cases"]
        read_only_fields = fields


class EvaluationSetUploadSerializer(serializers.Serializer):
    """For the schema: the multipart body of an upload (the view reads request.FILES itself)."""

    file = serializers.FileField(help_text=(
        'JSONL, one case a line: {"prompt": str} or {"messages": [...]}, optionally "expected" and "check" '
        "(exact, contains, regex, json_valid, json_schema), \"max_tokens\" (1-256, default 64), \"name\". "
        "Refused whole, with each bad line's number and reason; at most 200 cases and 1 MiB."))


class EvaluationResultSerializer(serializers.ModelSerializer):
    version = serializers.IntegerField(source="version.number", read_only=True)

    class Meta:
        model = EvaluationResult
        fields = ["case_index", "case_name", "version", "verdict", "output", "detail", "latency_ms",
                  "completion_tokens", "finish_reason"]
        read_only_fields = fields


class EvaluationRunSerializer(serializers.ModelSerializer):
    candidate = serializers.IntegerField(source="candidate.number", read_only=True)
    baseline = serializers.IntegerField(source="baseline.number", read_only=True, allow_null=True, default=None)
    evaluation_set = serializers.IntegerField(source="evaluation_set_id", read_only=True)
    checked_count = serializers.IntegerField(read_only=True)
    candidate_pass_rate = serializers.FloatField(source="candidate_rate", read_only=True, allow_null=True)
    baseline_pass_rate = serializers.FloatField(source="baseline_rate", read_only=True, allow_null=True)
    created_by = serializers.SlugRelatedField(slug_field="username", read_only=True)

    class Meta:
        model = EvaluationRun
        fields = ["id", "status", "trigger", "error", "candidate", "baseline", "evaluation_set", "checked_count",
                  "candidate_passed", "baseline_passed", "candidate_pass_rate", "baseline_pass_rate", "created_by",
                  "created_at", "started_at", "finished_at"]
        read_only_fields = fields


class ChangedCaseSerializer(serializers.Serializer):
    case_index = serializers.IntegerField(source="index")
    name = serializers.CharField()
    line = serializers.IntegerField()
    check = serializers.CharField(allow_null=True)
    candidate = EvaluationResultSerializer(allow_null=True)
    baseline = EvaluationResultSerializer(allow_null=True)


class EvaluationRunDetailSerializer(EvaluationRunSerializer):
    results = EvaluationResultSerializer(many=True, read_only=True)
    changed = serializers.SerializerMethodField(help_text="The cases whose verdict differs between the versions.")

    class Meta(EvaluationRunSerializer.Meta):
        fields = [*EvaluationRunSerializer.Meta.fields, "changed", "results"]
        read_only_fields = fields

    def get_changed(self, run) -> list[dict]:
        return ChangedCaseSerializer(self.context.get("changed", []), many=True).data

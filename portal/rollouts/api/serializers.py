from rest_framework import serializers

from portal.rollouts.models import CanaryGuard

SETTINGS = ("enabled", "min_requests", "error_rate_margin", "ttft_p95_factor")


class CanaryGuardSerializer(serializers.ModelSerializer):
    rolled_back_version = serializers.SlugRelatedField(slug_field="number", read_only=True)

    class Meta:
        model = CanaryGuard
        fields = [*SETTINGS, "last_checked_at", "rolled_back_version", "rolled_back_at", "rollback_figures",
                  "updated_at"]
        read_only_fields = fields

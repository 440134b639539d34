"""/api/v1/tenants/{tenant_slug}/adapters/{adapter_name}/canary-guard/: GET the guard of the
adapter's deployment, PUT/PATCH any of enabled, min_requests, error_rate_margin,
ttft_p95_factor (JSON types checked by the service: a bad one is a 400 naming it, nothing saved).
Roles as everywhere in the tenant API (portal.adapters.api.permissions)."""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.utils import extend_schema
from rest_framework.response import Response

from portal.adapters import deployments
from portal.adapters import selectors as adapter_selectors
from portal.adapters.api.views import TENANT, TenantScopedViewSet
from portal.core.exceptions import InvalidInput
from portal.rollouts import selectors, services
from portal.rollouts.api.serializers import SETTINGS, CanaryGuardSerializer


class CanaryGuardViewSet(TenantScopedViewSet):
    serializer_class = CanaryGuardSerializer

    def _deployment(self):
        adapter = adapter_selectors.adapter_get(tenant=self.tenant, name=self.kwargs["adapter_name"])
        if adapter is None:
            raise Http404("No such adapter.")
        return deployments.deployment_get(adapter=adapter)

    @extend_schema(parameters=[TENANT], summary="The canary guard of an adapter's deployment")
    def retrieve(self, request, *args, **kwargs):
        return Response(CanaryGuardSerializer(selectors.canary_guard_get(deployment=self._deployment())).data)

    @extend_schema(parameters=[TENANT], summary="Set the canary guard's thresholds (any of them)")
    def update(self, request, *args, **kwargs):
        deployment = self._deployment()
        if not isinstance(request.data, dict):
            raise InvalidInput("body", "expected a JSON object")
        unknown = sorted(set(request.data) - set(SETTINGS))
        if unknown:
            raise InvalidInput(unknown[0], f"not a canary guard setting (one of {', '.join(SETTINGS)})")
        guard = services.canary_guard_update(deployment=deployment, actor=self.actor,
                                             **{name: request.data[name] for name in SETTINGS if name in request.data})
        return Response(CanaryGuardSerializer(guard).data)

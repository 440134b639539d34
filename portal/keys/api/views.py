"""The keys REST API (thin: parse, check access, call a service, serialise).

    /api/v1/tenants/{tenant_slug}/keys/                 GET list, POST create (the secret is in this response only)
    /api/v1/tenants/{tenant_slug}/keys/{id}/            GET, PATCH (name, expiry, allow-list, limits), DELETE (= revoke)
    /api/v1/tenants/{tenant_slug}/keys/{id}/revoke/     POST
    /api/v1/tenants/{tenant_slug}/keys/{id}/rotate/     POST {"grace_period_seconds"} (a new secret, once)

Roles as everywhere in the tenant API (portal.adapters.api.permissions): viewers list and read,
members, admins and owners also create, revoke and rotate. An API key with an allow-list may
read but not manage keys: a key it created could use any model.
"""

from __future__ import annotations

from datetime import timedelta

from django.db import transaction
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status
from rest_framework.decorators import action
from rest_framework.exceptions import PermissionDenied
from rest_framework.permissions import SAFE_METHODS
from rest_framework.response import Response

from portal.adapters.api.views import TENANT, TenantScopedViewSet
from portal.keys import selectors, services
from portal.keys.api import serializers as s
from portal.keys.models import ApiKey
from portal.quotas.models import LIMIT_FIELDS
from portal.quotas.services import quota_set

KEY_ID = OpenApiParameter("id", OpenApiTypes.INT, OpenApiParameter.PATH, description="The key's id.")


@extend_schema_view(
    list=extend_schema(parameters=[TENANT], summary="List the tenant's API keys, newest first (never their secrets)"),
    retrieve=extend_schema(parameters=[TENANT, KEY_ID], summary="An API key"),
    partial_update=extend_schema(parameters=[TENANT, KEY_ID], request=s.ApiKeyUpdateSerializer,
                                 responses=s.ApiKeySerializer,
                                 summary="Change an API key's name, expiry, allow-list or limits"),
    destroy=extend_schema(parameters=[TENANT, KEY_ID], responses=s.ApiKeySerializer,
                          summary="Revoke an API key (same as POST .../revoke/)"),
)
class ApiKeyViewSet(TenantScopedViewSet, mixins.ListModelMixin):
    serializer_class = s.ApiKeySerializer
    lookup_value_regex = r"[0-9]{1,18}"

    def check_permissions(self, request):
        super().check_permissions(request)
        caller = request.auth if isinstance(request.auth, ApiKey) else None
        if request.method not in SAFE_METHODS and caller is not None and caller.allowed_models is not None:
            raise PermissionDenied("An API key limited to some models cannot create, revoke or rotate keys.")

    def get_queryset(self):
        return selectors.api_key_list(tenant=self.tenant).select_related("created_by", "quota")

    def get_object(self):
        api_key = selectors.api_key_get(tenant=self.tenant, pk=int(self.kwargs["pk"]))
        if api_key is None:
            raise Http404("No such API key.")
        return api_key

    def retrieve(self, request, *args, **kwargs):
        return Response(s.ApiKeySerializer(self.get_object()).data)

    @extend_schema(parameters=[TENANT], request=s.ApiKeyCreateSerializer, responses={201: s.ApiKeyCreatedSerializer},
                   summary="Create an API key; its secret is in this response only")
    def create(self, request, *args, **kwargs):
        data = s.ApiKeyCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        limits = {name: value for name, value in (data.validated_data.get("limits") or {}).items() if value is not None}
        with transaction.atomic():
            api_key, plaintext = services.api_key_create(
                tenant=self.tenant, name=data.validated_data["name"], created_by=self._person(),
                expires_at=data.validated_data.get("expires_at"), allowed_models=data.validated_data.get("allowed_models"),
            )
            if limits:
                quota_set(api_key=api_key, **limits)
        return Response(self._with_secret(api_key, plaintext), status=status.HTTP_201_CREATED)

    def partial_update(self, request, *args, **kwargs):
        api_key = self.get_object()
        data = s.ApiKeyUpdateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = {name: data.validated_data[name] for name in ("expires_at", "allowed_models") if name in data.validated_data}
        with transaction.atomic():
            api_key = services.api_key_update(api_key=api_key, name=data.validated_data.get("name"), **fields)
            if "limits" in data.validated_data:
                quota = getattr(api_key, "quota", None)
                current = {name: getattr(quota, name) for name in LIMIT_FIELDS} if quota is not None else {}
                merged = {name: value for name, value in {**current, **data.validated_data["limits"]}.items()
                          if value is not None}
                quota_set(api_key=api_key, **merged)
        return Response(self._with_secret(api_key, None))

    def destroy(self, request, *args, **kwargs):
        return self.revoke(request, *args, **kwargs)

    @extend_schema(parameters=[TENANT, KEY_ID], request=None, responses=s.ApiKeySerializer,
                   summary="Revoke an API key for good (its secret, and a rotated-out one in its grace period)")
    @action(detail=True, methods=["post"])
    def revoke(self, request, *args, **kwargs):
        api_key = services.api_key_revoke(api_key=self.get_object())
        return Response(s.ApiKeySerializer(api_key).data)

    @extend_schema(parameters=[TENANT, KEY_ID], request=s.ApiKeyRotateSerializer, responses=s.ApiKeyCreatedSerializer,
                   summary="Give an API key a new secret (shown once); the old one works for the grace period")
    @action(detail=True, methods=["post"])
    def rotate(self, request, *args, **kwargs):
        data = s.ApiKeyRotateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        grace = timedelta(seconds=data.validated_data["grace_period_seconds"])
        api_key, plaintext = services.api_key_rotate(api_key=self.get_object(), grace=grace)
        return Response(self._with_secret(api_key, plaintext))

    def _person(self):
        actor = self.actor
        return actor if actor is not None and actor.is_authenticated else None

    def _with_secret(self, api_key: ApiKey, plaintext: str | None) -> dict:
        """The key as stored now (its limits included), with its secret when there is one to show."""
        api_key = selectors.api_key_list(tenant=self.tenant).select_related("created_by", "quota").get(pk=api_key.pk)
        data = s.ApiKeySerializer(api_key).data
        return {"key": plaintext, **data} if plaintext is not None else data

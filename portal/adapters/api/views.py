"""The adapters REST API (thin: parse, check access, call a service, serialise).

    /api/v1/tenants/{tenant_slug}/adapters/                               GET list, POST create
    /api/v1/tenants/{tenant_slug}/adapters/{name}/                        GET, PATCH/PUT (description, base_model), DELETE
    /api/v1/tenants/{tenant_slug}/adapters/{name}/deployment/             GET, PUT (weights, always_warm, evaluation gate)
    /api/v1/tenants/{tenant_slug}/adapters/{name}/versions/               GET list, POST upload (multipart)
    /api/v1/tenants/{tenant_slug}/adapters/{name}/versions/{number}/      GET, DELETE (= retire)
    /api/v1/tenants/{tenant_slug}/adapters/{name}/versions/{number}/status/   GET
    /api/v1/tenants/{tenant_slug}/adapters/{name}/versions/{number}/retire/   POST
    /api/v1/tenants/{tenant_slug}/audit-events/                           GET list
"""

from __future__ import annotations

from django.core.files.uploadhandler import FileUploadHandler
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException
from rest_framework.parsers import FormParser, JSONParser, MultiPartParser
from rest_framework.response import Response

from portal.adapters import deployments, limits, selectors, services
from portal.adapters.api import serializers as s
from portal.adapters.api.permissions import TenantAccess
from portal.keys.models import ApiKey

TENANT = OpenApiParameter("tenant_slug", OpenApiTypes.STR, OpenApiParameter.PATH, description="The tenant's slug.")
ADAPTER = OpenApiParameter("adapter_name", OpenApiTypes.STR, OpenApiParameter.PATH, description="The adapter's name.")
NAME = OpenApiParameter("name", OpenApiTypes.STR, OpenApiParameter.PATH, description="The adapter's name.")
NUMBER = OpenApiParameter("number", OpenApiTypes.INT, OpenApiParameter.PATH, description="The version number.")
MULTIPART_SLACK = 1 << 20  # multipart boundaries and headers around the files


class UploadTooLarge(APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "limit_exceeded"


def _too_large(limit: int) -> UploadTooLarge:
    return UploadTooLarge(f"The upload is larger than the limit of {limit} bytes.")


class _CappedUploadHandler(FileUploadHandler):
    """Stops a multipart upload as soon as its files pass MAX_UPLOAD_BYTES (Content-Length can lie
    or be absent); the files themselves go to Django's temporary-file handler, never to memory
    past its threshold."""

    def __init__(self, request=None, *, limit: int):
        super().__init__(request)
        self.limit, self.total = limit, 0

    def receive_data_chunk(self, raw_data, start):
        self.total += len(raw_data)
        if self.total > self.limit:
            raise _too_large(self.limit)
        return raw_data

    def file_complete(self, file_size):
        return None


class TenantScopedViewSet(viewsets.GenericViewSet):
    # Authentication: settings.REST_FRAMEWORK (ApiKeyAuthentication, then the session).
    permission_classes = [TenantAccess]
    tenant = None  # set by TenantAccess

    @property
    def actor(self):
        """Who the audit trail names: the signed-in user, or the person who created the API key."""
        if isinstance(self.request.auth, ApiKey):
            return self.request.auth.created_by
        return self.request.user


@extend_schema_view(
    list=extend_schema(parameters=[TENANT], summary="List the tenant's adapters"),
    retrieve=extend_schema(parameters=[TENANT, NAME], summary="An adapter"),
    create=extend_schema(
        parameters=[TENANT], request=s.AdapterCreateSerializer, responses={201: s.AdapterSerializer},
        summary="Create an adapter (no versions yet)",
    ),
    update=extend_schema(parameters=[TENANT, NAME], request=s.AdapterUpdateSerializer, summary="Update an adapter"),
    partial_update=extend_schema(
        parameters=[TENANT, NAME], request=s.AdapterUpdateSerializer, summary="Update an adapter"
    ),
    destroy=extend_schema(parameters=[TENANT, NAME], summary="Delete an adapter and retire all its versions"),
)
class AdapterViewSet(TenantScopedViewSet, mixins.ListModelMixin):
    serializer_class = s.AdapterSerializer
    lookup_field = "name"
    lookup_value_regex = r"[^/]+"

    def get_queryset(self):
        return selectors.adapter_list(tenant=self.tenant)

    def get_object(self):
        adapter = selectors.adapter_get(tenant=self.tenant, name=self.kwargs["name"])
        if adapter is None:
            raise Http404("No such adapter.")
        return adapter

    def retrieve(self, request, *args, **kwargs):
        return Response(s.AdapterSerializer(self.get_object()).data)

    def create(self, request, *args, **kwargs):
        data = s.AdapterCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        adapter = services.adapter_create(tenant=self.tenant, actor=self.actor, **data.validated_data)
        return Response(s.AdapterSerializer(adapter).data, status=status.HTTP_201_CREATED)

    def update(self, request, *args, **kwargs):
        adapter = self.get_object()
        data = s.AdapterUpdateSerializer(data=request.data, partial=kwargs.get("partial", False))
        data.is_valid(raise_exception=True)
        adapter = services.adapter_update(adapter=adapter, actor=self.actor, **data.validated_data)
        return Response(s.AdapterSerializer(adapter).data)

    def partial_update(self, request, *args, **kwargs):
        return self.update(request, *args, partial=True, **kwargs)

    def destroy(self, request, *args, **kwargs):
        services.adapter_delete(adapter=self.get_object(), actor=self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(methods=["GET"], parameters=[TENANT, NAME], responses=s.DeploymentSerializer,
                   summary="The adapter's deployment (traffic weights over versions)")
    @extend_schema(methods=["PUT"], parameters=[TENANT, NAME], request=s.DeploymentUpdateSerializer,
                   responses=s.DeploymentSerializer, summary="Set traffic weights, always-warm and/or the evaluation gate (rollback = set weights)")
    @action(detail=True, methods=["get", "put"], serializer_class=s.DeploymentSerializer)
    def deployment(self, request, *args, **kwargs):
        adapter = self.get_object()
        if request.method == "PUT":
            data = s.DeploymentUpdateSerializer(data=request.data)
            data.is_valid(raise_exception=True)
            deployments.deployment_update(adapter=adapter, actor=self.actor, **data.validated_data)
        return Response(s.DeploymentSerializer(deployments.deployment_get(adapter=adapter)).data)


@extend_schema_view(
    list=extend_schema(parameters=[TENANT, ADAPTER], summary="List an adapter's versions, newest first"),
    retrieve=extend_schema(parameters=[TENANT, ADAPTER, NUMBER], summary="A version"),
    destroy=extend_schema(parameters=[TENANT, ADAPTER, NUMBER], responses=s.VersionSerializer,
                          summary="Retire a version (same as POST .../retire/)"),
)
class VersionViewSet(TenantScopedViewSet, mixins.ListModelMixin):
    serializer_class = s.VersionSerializer
    lookup_field = "number"
    lookup_value_regex = r"[0-9]{1,9}"
    parser_classes = [MultiPartParser, FormParser, JSONParser]

    def initialize_request(self, request, *args, **kwargs):
        if request.method == "POST" and request.content_type.startswith("multipart/"):
            limit = limits.max_upload_bytes()
            request.upload_handlers = [_CappedUploadHandler(request, limit=limit), *request.upload_handlers]
        return super().initialize_request(request, *args, **kwargs)

    def get_adapter(self):
        adapter = selectors.adapter_get(tenant=self.tenant, name=self.kwargs["adapter_name"])
        if adapter is None:
            raise Http404("No such adapter.")
        return adapter

    def get_queryset(self):
        return selectors.adapter_version_list(adapter=self.get_adapter())

    def get_object(self):
        version = selectors.adapter_version_get(adapter=self.get_adapter(), number=int(self.kwargs["number"]))
        if version is None:
            raise Http404("No such version.")
        return version

    def retrieve(self, request, *args, **kwargs):
        return Response(s.VersionSerializer(self.get_object()).data)

    @extend_schema(
        parameters=[TENANT, ADAPTER],
        request={"multipart/form-data": s.VersionUploadSerializer},
        responses={202: s.VersionSerializer},
        summary="Upload a new version (validated in the background; poll .../status/)",
    )
    def create(self, request, *args, **kwargs):
        adapter = self.get_adapter()
        length = request.META.get("CONTENT_LENGTH")
        limit = limits.max_upload_bytes()
        if length and length.isdigit() and int(length) > limit + MULTIPART_SLACK:
            raise _too_large(limit)
        if not request.content_type.startswith("multipart/form-data"):
            return Response(
                {"detail": "Upload the files as multipart/form-data in a field named 'files'.", "code": "invalid"},
                status=status.HTTP_415_UNSUPPORTED_MEDIA_TYPE,
            )
        files = [f for key in request.FILES for f in request.FILES.getlist(key)]
        version = services.adapter_version_upload(adapter=adapter, files=files, actor=self.actor)
        return Response(s.VersionSerializer(version).data, status=status.HTTP_202_ACCEPTED)

    def destroy(self, request, *args, **kwargs):
        return self.retire(request, *args, **kwargs)

    @extend_schema(parameters=[TENANT, ADAPTER, NUMBER], request=None, responses=s.VersionSerializer,
                   summary="Retire a version: unloaded from every worker, files deleted, never served again")
    @action(detail=True, methods=["post"])
    def retire(self, request, *args, **kwargs):
        version = services.adapter_version_retire(version=self.get_object(), actor=self.actor)
        return Response(s.VersionSerializer(version).data)

    @extend_schema(parameters=[TENANT, ADAPTER, NUMBER], responses=s.VersionStatusSerializer,
                   summary="A version's status, rejection reasons and per-worker staging")
    @action(detail=True, methods=["get"], serializer_class=s.VersionStatusSerializer)
    def status(self, request, *args, **kwargs):
        return Response(s.VersionStatusSerializer(self.get_object()).data)


@extend_schema_view(list=extend_schema(parameters=[TENANT], summary="Who changed what, newest first"))
class AuditEventViewSet(TenantScopedViewSet, mixins.ListModelMixin):
    serializer_class = s.AuditEventSerializer

    def get_queryset(self):
        return selectors.audit_event_list(tenant=self.tenant)

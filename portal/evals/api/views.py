"""The evaluation REST API (thin: parse, check access, call a service, serialise).

    /api/v1/tenants/{t}/adapters/{name}/evaluation-set/                     GET the current set, POST upload (multipart `file`)
    /api/v1/tenants/{t}/adapters/{name}/versions/{n}/evaluation-runs/       GET the version's runs, POST run again
    /api/v1/tenants/{t}/adapters/{name}/versions/{n}/evaluation-runs/{id}/  GET one run: pass rates, changed cases, results
"""

from __future__ import annotations

from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status
from rest_framework.parsers import FormParser, MultiPartParser
from rest_framework.response import Response

from portal.adapters import selectors as adapter_selectors
from portal.adapters.api.views import ADAPTER, NUMBER, TENANT, TenantScopedViewSet
from portal.core.exceptions import InvalidInput
from portal.evals import selectors, services
from portal.evals.api import serializers as s
from portal.evals.validation import MAX_FILE_BYTES

RUN_ID = OpenApiParameter("id", OpenApiTypes.INT, OpenApiParameter.PATH, description="The run's id.")


class _AdapterScoped(TenantScopedViewSet):
    def get_adapter(self):
        adapter = adapter_selectors.adapter_get(tenant=self.tenant, name=self.kwargs["adapter_name"])
        if adapter is None:
            raise Http404("No such adapter.")
        return adapter

    def get_version(self):
        version = adapter_selectors.adapter_version_get(adapter=self.get_adapter(), number=int(self.kwargs["number"]))
        if version is None:
            raise Http404("No such version.")
        return version


class EvaluationSetViewSet(_AdapterScoped):
    serializer_class = s.EvaluationSetSerializer
    parser_classes = [MultiPartParser, FormParser]

    @extend_schema(parameters=[TENANT, ADAPTER], summary="The adapter's evaluation set (404: none uploaded)")
    def list(self, request, *args, **kwargs):
        evaluation_set = selectors.evaluation_set_current(adapter=self.get_adapter())
        if evaluation_set is None:
            raise Http404("This adapter has no evaluation set.")
        return Response(s.EvaluationSetSerializer(evaluation_set).data)

    @extend_schema(parameters=[TENANT, ADAPTER], request={"multipart/form-data": s.EvaluationSetUploadSerializer},
                   responses={201: s.EvaluationSetSerializer},
                   summary="Upload the evaluation set (replaces the current one; runs when a version becomes ready)")
    def create(self, request, *args, **kwargs):
        adapter = self.get_adapter()
        upload = request.FILES.get("file")
        if upload is None:
            raise InvalidInput("file", "send the JSONL as multipart/form-data in a field named 'file'")
        if upload.size > MAX_FILE_BYTES:
            raise InvalidInput("file", f"the file is {upload.size} bytes; the limit is {MAX_FILE_BYTES} bytes")
        evaluation_set = services.evaluation_set_upload(adapter=adapter, data=upload.read(), filename=upload.name,
                                                        actor=self.actor)
        return Response(s.EvaluationSetSerializer(evaluation_set).data, status=status.HTTP_201_CREATED)


@extend_schema_view(
    list=extend_schema(parameters=[TENANT, ADAPTER, NUMBER], summary="A version's evaluation runs, newest first"),
)
class EvaluationRunViewSet(_AdapterScoped, mixins.ListModelMixin):
    serializer_class = s.EvaluationRunSerializer
    lookup_value_regex = r"[0-9]{1,12}"

    def get_queryset(self):
        return selectors.evaluation_run_list(version=self.get_version())

    @extend_schema(parameters=[TENANT, ADAPTER, NUMBER, RUN_ID], responses=s.EvaluationRunDetailSerializer,
                   summary="One run: both versions' pass rates, the cases whose verdict changed, every result")
    def retrieve(self, request, *args, **kwargs):
        run = selectors.evaluation_run_get(version=self.get_version(), run_id=int(self.kwargs["pk"]))
        if run is None:
            raise Http404("No such run.")
        changed = [row for row in selectors.evaluation_run_rows(run=run) if row.changed]
        return Response(s.EvaluationRunDetailSerializer(run, context={"changed": changed}).data)

    @extend_schema(parameters=[TENANT, ADAPTER, NUMBER], request=None, responses={202: s.EvaluationRunSerializer},
                   summary="Run the evaluation again (against the version serving now)")
    def create(self, request, *args, **kwargs):
        run = services.evaluation_run_again(version=self.get_version(), actor=self.actor)
        run.refresh_from_db()
        return Response(s.EvaluationRunSerializer(run).data, status=status.HTTP_202_ACCEPTED)

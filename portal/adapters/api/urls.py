"""/api/v1/ (mounted from portal/urls.py): the tenant-scoped REST API."""

from django.urls import re_path
from rest_framework.routers import SimpleRouter

from portal.adapters.api import views
from portal.keys.api.views import ApiKeyViewSet
from portal.rollouts.api.views import CanaryGuardViewSet

TENANT = r"tenants/(?P<tenant_slug>[a-z0-9](?:[a-z0-9-]{0,48}[a-z0-9])?)"

router = SimpleRouter()
router.register(rf"{TENANT}/adapters", views.AdapterViewSet, basename="adapter")
router.register(rf"{TENANT}/adapters/(?P<adapter_name>[^/]+)/versions", views.VersionViewSet, basename="adapter-version")
router.register(rf"{TENANT}/audit-events", views.AuditEventViewSet, basename="audit-event")
router.register(rf"{TENANT}/keys", ApiKeyViewSet, basename="api-key")

guard = CanaryGuardViewSet.as_view({"get": "retrieve", "put": "update", "patch": "update"})

app_name = "api"
urlpatterns = [*router.urls, re_path(rf"^{TENANT}/adapters/(?P<adapter_name>[^/]+)/canary-guard/$", guard,
                                     name="adapter-canary-guard")]

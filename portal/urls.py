from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

urlpatterns = [
    path("", include("portal.core.urls")),
    path("", include("portal.console.urls")),  # the tenant portal: /login/, /t/<slug>/...
    path("", include("portal.playground.urls")),  # /t/<slug>/playground/ (its websocket: portal/asgi.py)
    path("dashboards/", include("portal.dashboards.urls")),  # staff only
    path("admin/", admin.site.urls),
    path("v1/", include("portal.gateway.urls")),  # the OpenAI-compatible API
    path("usage/", include("portal.usage.urls")),
    path("api/v1/", include("portal.adapters.api.urls")),  # the tenant REST API (DRF)
    path("api/v1/", include("portal.evals.api.urls")),  # evaluation sets and runs (same API)
    path("", include("portal.evals.urls")),  # /t/<slug>/adapters/<name>/evaluation/, versions/<n>/
    path("internal/", include("portal.adapters.internal_urls")),  # for the inference workers only
    path("api/schema/", SpectacularAPIView.as_view(), name="api-schema"),  # OpenAPI 3
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="api-schema"), name="api-docs"),
]

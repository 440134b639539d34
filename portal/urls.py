from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("portal.core.urls")),
    path("admin/", admin.site.urls),
    path("v1/", include("portal.gateway.urls")),  # the OpenAI-compatible API
    path("usage/", include("portal.usage.urls")),
]

"""Routes for the inference fleet (mounted at /internal/ by portal/urls.py); not for tenants."""

from django.urls import path

from portal.adapters import internal_views

app_name = "internal"

urlpatterns = [
    path("adapters/<uuid:uid>/<str:filename>", internal_views.adapter_file, name="adapter-file"),
]

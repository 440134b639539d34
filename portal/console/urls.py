"""The tenant portal's pages (mounted at the site root by portal/urls.py)."""

from django.urls import path

from portal.console import views

app_name = "console"
T = "t/<slug:slug>/"
urlpatterns = [
    path("login/", views.LoginView.as_view(), name="login"),
    path("logout/", views.LogoutView.as_view(), name="logout"),
    path("t/", views.tenant_picker, name="tenants"),
    path(T, views.overview, name="overview"),
    path(T + "keys/", views.keys, name="keys"),
    path(T + "keys/<int:key_id>/revoke/", views.key_revoke, name="key-revoke"),
    path(T + "adapters/", views.adapters, name="adapters"),
    path(T + "adapters/<str:name>/", views.adapter_detail, name="adapter"),
    path(T + "adapters/<str:name>/upload/", views.adapter_upload, name="adapter-upload"),
    path(T + "adapters/<str:name>/deployment/", views.adapter_deployment, name="adapter-deployment"),
    path(T + "adapters/<str:name>/always-warm/", views.adapter_always_warm, name="adapter-always-warm"),
    path(T + "adapters/<str:name>/canary-guard/", views.adapter_canary_guard, name="adapter-canary-guard"),
    path(T + "adapters/<str:name>/canary-guard/dismiss/", views.adapter_canary_dismiss, name="adapter-canary-dismiss"),
    path(T + "usage/", views.usage, name="usage"),
    path(T + "usage/daily.json", views.usage_daily_json, name="usage-daily-json"),
    path(T + "usage/models.json", views.usage_models_json, name="usage-models-json"),
    path(T + "billing/", views.billing, name="billing"),
]

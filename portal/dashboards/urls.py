from django.urls import path

from portal.dashboards import views

app_name = "dashboards"

urlpatterns = [
    path("", views.fleet, name="fleet"),
    path("tenants/", views.tenants, name="tenants"),
    path("latency/", views.latency, name="latency"),
    path("adapters/", views.adapters, name="adapters"),
    path("billing/", views.billing, name="billing"),
    path("api/fleet.json", views.fleet_json, name="fleet-json"),
    path("api/tenants.json", views.tenants_json, name="tenants-json"),
    path("api/latency.json", views.latency_json, name="latency-json"),
    path("api/adapters.json", views.adapters_json, name="adapters-json"),
    path("api/billing.json", views.billing_json, name="billing-json"),
]

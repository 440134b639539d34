from django.urls import path

from portal.dashboards import views

app_name = "dashboards"

urlpatterns = [
    path("", views.fleet, name="fleet"),
    path("tenants/", views.tenants, name="tenants"),
    path("latency/", views.latency, name="latency"),
    path("errors/", views.errors, name="errors"),
    path("objectives/", views.objectives, name="objectives"),
    path("adapters/", views.adapters, name="adapters"),
    path("billing/", views.billing, name="billing"),
    path("api/fleet.json", views.fleet_json, name="fleet-json"),
    path("api/fleet-history.json", views.fleet_history_json, name="fleet-history-json"),
    path("api/tenants.json", views.tenants_json, name="tenants-json"),
    path("api/latency.json", views.latency_json, name="latency-json"),
    path("api/errors.json", views.errors_json, name="errors-json"),
    path("api/objectives.json", views.objectives_json, name="objectives-json"),
    path("api/adapters.json", views.adapters_json, name="adapters-json"),
    path("api/billing.json", views.billing_json, name="billing-json"),
]

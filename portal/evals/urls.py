"""The evaluation pages (mounted at the site root, beside portal.console's)."""

from django.urls import path

from portal.evals import views

app_name = "evals"
A = "t/<slug:slug>/adapters/<str:name>/"
urlpatterns = [
    path(A + "evaluation/", views.adapter_evaluation, name="adapter"),
    path(A + "evaluation/gate/", views.adapter_gate, name="gate"),
    path(A + "versions/<int:number>/", views.version_detail, name="version"),
    path(A + "versions/<int:number>/evaluate/", views.version_evaluate, name="evaluate"),
]

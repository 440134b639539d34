from django.urls import path, re_path

from portal.usage import views

app_name = "usage"
urlpatterns = [
    re_path(
        r"^(?P<tenant_slug>[-a-z0-9]+)/statement/(?P<year>[0-9]{4})-(?P<month>[0-9]{2})\.csv$",
        views.statement_csv,
        name="statement-csv",
    ),
    path("<slug:tenant_slug>/records.csv", views.records_csv, name="records-csv"),
]

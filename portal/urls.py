from django.contrib import admin
from django.urls import include, path

urlpatterns = [
    path("", include("portal.core.urls")),
    path("admin/", admin.site.urls),
]

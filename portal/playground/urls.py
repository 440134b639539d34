from django.urls import path

from portal.playground import views

app_name = "playground"

urlpatterns = [
    path("t/<slug:slug>/playground/", views.playground, name="playground"),
]

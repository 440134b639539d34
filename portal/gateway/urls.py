from django.urls import path, re_path

from portal.gateway import views

app_name = "gateway"
urlpatterns = [
    path("chat/completions", views.chat_completions, name="chat-completions"),
    path("completions", views.completions, name="completions"),
    path("models", views.models, name="models"),
    path("feedback", views.feedback, name="feedback"),
    re_path(r"^(?P<path>.*)$", views.not_found, name="not-found"),
]

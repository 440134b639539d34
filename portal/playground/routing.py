from django.urls import path

from portal.playground.consumers import PlaygroundConsumer

websocket_urlpatterns = [
    path("ws/t/<slug:slug>/playground/", PlaygroundConsumer.as_asgi()),
]

"""API-key authentication for the REST API: `Authorization: Bearer sk-...`.

request.user stays anonymous and request.auth is the ApiKey: a key acts for its tenant, not
for a person (the permission class reads the tenant from it)."""

from __future__ import annotations

from django.contrib.auth.models import AnonymousUser
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed

from portal.keys.selectors import api_key_authenticate
from portal.keys.services import api_key_record_use


class ApiKeyAuthentication(BaseAuthentication):
    keyword = b"bearer"

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword:
            return None  # not ours: the session authentication may still apply
        if len(parts) != 2:
            raise AuthenticationFailed("The Authorization header must be 'Bearer <API key>'.")
        try:
            plaintext = parts[1].decode("ascii")
        except UnicodeDecodeError:
            raise AuthenticationFailed("The API key is not valid.") from None
        api_key = api_key_authenticate(plaintext)
        if api_key is None:
            raise AuthenticationFailed("The API key is not valid, or it was revoked or has expired.")
        api_key_record_use(api_key=api_key)
        return AnonymousUser(), api_key

    def authenticate_header(self, request) -> str:
        return 'Bearer realm="api"'


class ApiKeyAuthenticationScheme(OpenApiAuthenticationExtension):
    """How the OpenAPI schema describes ApiKeyAuthentication: an HTTP bearer token."""

    target_class = ApiKeyAuthentication
    name = "ApiKeyAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "A tenant API key: `Authorization: Bearer sk-...`."}

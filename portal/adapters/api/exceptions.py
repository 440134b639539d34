"""Domain exceptions -> REST API errors, in one place (settings.REST_FRAMEWORK EXCEPTION_HANDLER).

Every error body is {"detail": "...", "code": "..."} plus "field" when one input is at fault."""

from __future__ import annotations

from django.core.exceptions import NON_FIELD_ERRORS
from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from portal.adapters.limits import LimitExceeded
from portal.core.exceptions import InvalidInput


def exception_handler(exc, context):
    if isinstance(exc, LimitExceeded):
        return Response(
            {"detail": exc.message, "field": exc.field, "code": "limit_exceeded"}, status=exc.status_code
        )
    if isinstance(exc, InvalidInput):
        return Response({"detail": exc.message, "field": exc.field, "code": "invalid"}, status=status.HTTP_400_BAD_REQUEST)
    if isinstance(exc, DjangoValidationError):
        if hasattr(exc, "error_dict"):
            field, messages = next(iter(exc.message_dict.items()))
            body = {"detail": " ".join(messages), "code": "invalid"}
            if field != NON_FIELD_ERRORS:
                body["field"] = field
        else:
            body = {"detail": " ".join(exc.messages), "code": "invalid"}
        return Response(body, status=status.HTTP_400_BAD_REQUEST)
    response = drf_exception_handler(exc, context)
    if response is not None and isinstance(response.data, dict) and "detail" in response.data:
        code = getattr(response.data["detail"], "code", None)
        if code and "code" not in response.data:
            response.data["code"] = code
    elif response is not None and isinstance(response.data, dict | list):
        # Serializer errors: keep DRF's per-field messages and add a one-line summary.
        response.data = {"detail": _summary(response.data), "code": "invalid", "errors": response.data}
    return response


def _summary(errors) -> str:
    if isinstance(errors, dict):
        parts = []
        for field, messages in errors.items():
            text = _summary(messages)
            parts.append(text if field in ("non_field_errors", NON_FIELD_ERRORS) else f"{field}: {text}")
        return "; ".join(parts)
    if isinstance(errors, list):
        return " ".join(_summary(e) for e in errors)
    return str(errors)

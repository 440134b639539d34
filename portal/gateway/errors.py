"""The gateway's one error type, in OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

Services raise GatewayError; views (HTTP) and the playground consumer (websocket) render it.
"""

from __future__ import annotations


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_api_key() -> GatewayError:
    return GatewayError(
        401,
        "Incorrect API key provided. You can find your API keys in the portal.",
        code="invalid_api_key",
    )


def missing_api_key() -> GatewayError:
    return GatewayError(
        401,
        "You didn't provide an API key. Send it in the Authorization header: `Authorization: Bearer sk-...`.",
        code="invalid_api_key",
    )


def tenant_suspended(slug: str) -> GatewayError:
    return GatewayError(
        403,
        f"The account `{slug}` is suspended; API requests are refused until it is reactivated.",
        type="access_denied",
        code="tenant_suspended",
    )


def model_not_found(model: str) -> GatewayError:
    return GatewayError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )


def no_worker(detail: str, *, retry_after: int | None = None) -> GatewayError:
    headers = {"retry-after": str(retry_after)} if retry_after else {}
    return GatewayError(
        503,
        f"No inference worker could take the request; retry shortly. ({detail})",
        type="service_unavailable",
        code="no_worker_available",
        headers=headers,
    )

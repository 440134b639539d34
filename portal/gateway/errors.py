"""The gateway's one error type, in OpenAI's shape:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}

Services raise GatewayError; views (HTTP) and the playground consumer (websocket) render it.
"""

from __future__ import annotations

import logging
import re

import redis
from django.db import InterfaceError, OperationalError

log = logging.getLogger(__name__)
# Seconds a client is told to wait when a service the gateway depends on is unreachable.
SERVICE_RETRY_AFTER = 2


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


def invalid_api_key(reason: str | None = None) -> GatewayError:
    """401 for a secret that does not authenticate; `reason` when it is a key we know (revoked,
    expired, rotated out past its grace period)."""
    return GatewayError(
        401,
        f"{reason} You can find your API keys in the portal." if reason
        else "Incorrect API key provided. You can find your API keys in the portal.",
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
    """503: no worker took the request. `detail` (which workers failed and how: their addresses)
    is for the operators' log only; the client is never told the fleet's internal addresses."""
    log.info("no worker available: %s", detail)
    headers = {"retry-after": str(retry_after)} if retry_after else {}
    return GatewayError(
        503,
        "No inference worker could take the request; retry shortly.",
        type="service_unavailable",
        code="no_worker_available",
        headers=headers,
    )


# What a worker's own message may carry about where things live: URLs, IPv4/IPv6 addresses,
# host:port pairs. None of it is the client's business (portal.gateway.relay scrubs with it).
_ADDRESS = re.compile(
    r"[a-z][a-z0-9+.-]*://[^\s'\"<>)]+"  # a URL
    r"|\[[0-9a-f:.]+\](?::\d+)?"  # [IPv6]:port
    r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"  # IPv4[:port]
    r"|\b(?:localhost|[a-z0-9]+(?:[.-][a-z0-9]+)+):\d{2,5}\b",  # host:port (a dotted or hyphened host)
    re.IGNORECASE,
)


def without_addresses(text: str) -> str:
    """`text` with every URL, IP address and host:port replaced by "[internal]"."""
    return _ADDRESS.sub("[internal]", text) if isinstance(text, str) else text


def unexpected(exc: BaseException, *, request_id: str) -> GatewayError:
    """What a client is told about a failure that is not its request's fault: the database or
    Redis unreachable (or the connection pool exhausted) is a 503 to retry; anything else a
    500, logged with its traceback under the request id."""
    if isinstance(exc, OperationalError | InterfaceError):
        log.warning("%s: database unavailable: %s: %s", request_id, type(exc).__name__, str(exc).strip()[:300])
        return GatewayError(503, "The service's database is unavailable; retry shortly.", type="service_unavailable",
                            code="service_unavailable", headers={"retry-after": str(SERVICE_RETRY_AFTER)})
    if isinstance(exc, redis.RedisError):
        log.warning("%s: Redis unavailable: %s: %s", request_id, type(exc).__name__, str(exc).strip()[:300])
        return GatewayError(503, "The service's rate limiter is unavailable; retry shortly.",
                            type="service_unavailable", code="service_unavailable",
                            headers={"retry-after": str(SERVICE_RETRY_AFTER)})
    log.error("%s: unexpected gateway error", request_id, exc_info=exc)
    return GatewayError(500, f"The gateway failed on this request; retry, and quote {request_id} if it persists.",
                        type="server_error", code="internal_error")

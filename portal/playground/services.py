"""The playground's entry into the gateway pipeline for a tenant already authenticated by its
session (no API key): the same validation, model resolution, quotas, routing, lazy adapter
load and usage ledger as /v1, by calling portal.gateway.services' own functions.

Why an adapter at all: the gateway's `completion_stream` takes an ApiKey and reads the tenant
from it; its Ledger writes `api_key=` that key. A session has a tenant and no key, and the
ledger's api_key column is then None. Everything that only *reads* the key (model resolution,
the allow-list, /v1/models, the plan's scheduling weight) is called here with a
`SessionPrincipal` standing in for it (tenant, no allow-list); the two places that *write* with
the key are mirrored: quota admission (quota_admit(api_key=None)) and the ledger row
(SessionLedger). The hook that makes this file unnecessary: completion_stream(*, tenant,
api_key: ApiKey | None, ...) with Ledger carrying `tenant` and an optional `api_key`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from asgiref.sync import sync_to_async
from django.utils import timezone

from portal.gateway import services as gateway
from portal.gateway import validation
from portal.gateway.errors import GatewayError, tenant_suspended
from portal.quotas.services import QuotaExceeded, quota_admit, quota_settle
from portal.tenants.models import Tenant

CHAT = validation.CHAT


@dataclass(frozen=True)
class SessionPrincipal:
    """What the gateway's read-only helpers need of an ApiKey: the tenant and its allow-list
    (a session may use every model of its tenant)."""

    tenant: Tenant
    allowed_models: list[str] | None = None
    pk: None = None


@dataclass
class SessionLedger(gateway.Ledger):
    """The gateway's Ledger for a request with no API key: identical bookkeeping, the row is
    written with api_key=None and the tenant of the session."""

    tenant: Tenant | None = None

    async def _finish(self) -> None:  # mirrors gateway.Ledger._finish, api_key=None
        if self._closed:
            return
        self._closed = True
        if self.upstream is not None:
            try:
                await self.upstream.aclose()  # mid-stream: the worker sees the disconnect and aborts
            except Exception:  # noqa: BLE001 -- closing a dead connection may fail; nothing to do
                gateway.log.debug("closing the upstream of %s failed", self.request_id, exc_info=True)
        prompt = self.prompt_tokens if self.prompt_tokens is not None else (
            self.estimated_prompt_tokens if self.first_chunk_at is not None else 0)
        completion = self.completion_tokens if self.completion_tokens is not None else self.relayed_tokens
        if self.admission is not None:
            try:
                await quota_settle(admission=self.admission, prompt_tokens=prompt, completion_tokens=completion)
            except Exception:
                gateway.log.exception("quota_settle failed for %s", self.request_id)
        now = time.monotonic()
        fields = dict(
            request_id=self.request_id,
            tenant=self.tenant,
            api_key=None,
            model=self.model[:200],
            adapter_version=self.version,
            worker_url=self.worker_url,
            stream=self.stream,
            prompt_tokens=prompt,
            completion_tokens=completion,
            time_to_first_token_ms=(
                (self.first_chunk_at - self.started) * 1000 if self.first_chunk_at is not None else None),
            latency_ms=(now - self.started) * 1000,
            finish_reason=self.finish_reason or "",
            error=self.error,
            status_code=self.status_code,
            client_disconnected=self.client_disconnected,
            created_at=self.started_at,
            finished_at=timezone.now(),
        )
        try:
            await sync_to_async(gateway._write_usage, thread_sensitive=False)(fields)
        except Exception:
            gateway.log.exception("usage_record_create failed for %s", self.request_id)


async def playground_models(*, tenant: Tenant) -> list[dict]:
    """What /v1/models lists for a key of this tenant with no allow-list."""
    principal = SessionPrincipal(tenant)
    return await sync_to_async(gateway._models_list)(principal, await gateway.base_model())


async def _admit(tenant: Tenant, request_id: str, estimated: int):
    # gateway._admit, with api_key=None: the tenant's quota alone.
    try:
        return await quota_admit(tenant=tenant, api_key=None, request_id=request_id, estimated_tokens=estimated)
    except QuotaExceeded as exc:
        headers = dict(getattr(exc, "headers", None) or {})
        headers["retry-after"] = str(max(1, int(exc.retry_after or 1)))
        kind = "insufficient_quota" if not exc.should_retry else (
            "tokens" if "token" in str(exc.limit) else "requests")
        raise GatewayError(429, exc.message, type=kind, code="rate_limit_exceeded", headers=headers) from None


async def playground_completion_stream(*, tenant: Tenant, body: dict, request_id: str) -> gateway.Completion:
    """gateway.completion_stream for a session's tenant, always a streamed chat completion with
    the usage chunk. Raises GatewayError before the first byte; every request is written to the
    ledger once (the returned Completion's chunks()/aclose() write it when the stream ends)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    model = body.get("model") if isinstance(body.get("model"), str) else ""
    principal = SessionPrincipal(tenant)
    ledger = SessionLedger(request_id=request_id, api_key=None, model=model, stream=True, tenant=tenant)
    streaming = False
    try:
        if not tenant.is_active:
            raise tenant_suspended(tenant.slug)
        validation.validate(CHAT, body)
        target = await gateway.model_resolve(api_key=principal, model=body["model"], request_id=request_id)
        ledger.model = target.public_id
        ledger.version = target.version
        estimated = validation.estimate_tokens(CHAT, body, default_max_tokens=gateway.DEFAULT_MAX_TOKENS_ESTIMATE)
        ledger.estimated_prompt_tokens = validation.estimate_prompt_tokens(CHAT, body)
        ledger.admission = await _admit(tenant, request_id, estimated)
        headers = dict(getattr(ledger.admission, "headers", None) or {})
        payload = dict(body, model=target.worker_model, tenant=tenant.slug,
                       tenant_weight=gateway._tenant_weight(principal))
        response = await gateway._open_upstream(CHAT, payload, target, ledger)
        ledger.upstream = response
        completion = gateway.Completion(request_id=request_id, model=target.public_id, stream=True,
                                        include_usage=True, headers=headers, target=target, ledger=ledger)
        streaming = True  # from here the completion owns the ledger
        completion.arm_watchdog()
        return completion
    except GatewayError as exc:
        ledger.status_code = exc.status
        ledger.error = exc.message
        raise
    except asyncio.CancelledError:
        ledger.client_disconnected = True
        ledger.status_code = 499
        raise
    except Exception as exc:
        ledger.status_code = 500
        ledger.error = f"gateway error: {type(exc).__name__}: {exc}"
        raise
    finally:
        if not streaming:
            await ledger.close()

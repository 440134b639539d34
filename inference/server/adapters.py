"""Adapter management routes, compatible with vLLM's (`/v1/load_lora_adapter`,
`/v1/unload_lora_adapter`), plus pin/unpin and a listing with each adapter's cache state. The
routes, bodies and error codes are protocol.worker_api's, shared with the portal's client.

A load names its adapter either by a local directory (`lora_path`, vLLM's field) or by a URL
to fetch it from (`lora_url` + `files` {filename: sha256}, optional `auth_token` sent to that
URL as a Bearer token): the worker downloads both PEFT files into its adapter cache, checks
their sha256 and size (inference/server/fetch.py), then loads the directory as a path.
Fetch errors are 400s with the reason (codes adapter_fetch_failed, adapter_checksum_mismatch,
adapter_too_large); a `lora_url` outside the configured portal origins (INFERENCE_PORTAL_ORIGINS,
none by default) is a 400 adapter_source_forbidden and nothing is requested from it.

Loading validates and reads the adapter on the engine's loader, never on the event loop
(`add_adapter(wait=False)` hands back a future). A bad adapter is a 400 with the validation
reason and never disturbs the adapters already resident. When an admin token is configured,
these routes need `Authorization: Bearer <token>` (the gateway holds the token).

Load and unload exist only with INFERENCE_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM's only exist
with VLLM_ALLOW_RUNTIME_LORA_UPDATING (`runtime_router`); otherwise they are 404s that say so
(`disabled_runtime_router`). Pinning and the listing work on the adapters registered at start-up.
"""

from __future__ import annotations

import asyncio
import secrets

from fastapi import APIRouter, Depends, Request

from inference.lora.errors import AdapterError
from inference.server.errors import APIError
from inference.server.fetch import FetchError, FetchSettings, fetch_adapter
from inference.server.protocol import LoadLoraAdapterRequest, UnloadAdapterRequest
from protocol import worker_api


def _require_admin(request: Request) -> None:
    token = request.app.state.admin_token
    if not token:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "adapter routes need 'Authorization: Bearer <admin token>'",
                       type="authentication_error", code=worker_api.INVALID_ADMIN_TOKEN)


router = APIRouter(dependencies=[Depends(_require_admin)])
runtime_router = APIRouter(dependencies=[Depends(_require_admin)])  # load / unload
disabled_runtime_router = APIRouter()


@disabled_runtime_router.post(worker_api.LOAD_ADAPTER)
@disabled_runtime_router.post(worker_api.UNLOAD_ADAPTER)
async def runtime_lora_updating_disabled() -> None:
    raise APIError(404, "loading and unloading adapters at run time is off on this worker (start it with "
                        "INFERENCE_ALLOW_RUNTIME_LORA_UPDATING=true, vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
                   type="not_found_error", code=worker_api.RUNTIME_LORA_UPDATING_DISABLED)


def adapter_json(info) -> dict:
    return {
        "name": info.name,
        "id": info.id,
        "path": str(info.path),
        "tier": info.tier,
        "rank": info.rank,
        "bytes": info.nbytes,
        "pinned": info.pinned,
        "hits": info.hits,
        "last_used": info.last_used,
        "load_seconds": info.load_seconds,
        "error": info.error,
    }


def _engine(request: Request):
    serving = request.app.state.serving
    serving.check_ready()
    return serving.engine.engine


def _not_found(name: str) -> APIError:
    return APIError(404, f"adapter '{name}' is not registered", param="lora_name",
                    code=worker_api.ADAPTER_NOT_FOUND)


@runtime_router.post(worker_api.LOAD_ADAPTER)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> dict:
    engine = _engine(request)
    if body.lora_name in request.app.state.serving.served_names:
        raise APIError(400, f"lora_name: '{body.lora_name}' is the base model's name", param="lora_name")
    try:
        load = body.to_protocol()
    except worker_api.BodyError as exc:  # one source, and a URL with its files
        raise APIError(400, exc.message, param=exc.param) from None
    path = load.lora_path
    if load.lora_url is not None:
        try:
            path = str(await fetch_adapter(lora_name=load.lora_name, lora_url=load.lora_url, files=load.files,
                                           allowed_origins=request.app.state.portal_origins,
                                           auth_token=load.auth_token, settings=_fetch_settings(request)))
        except FetchError as exc:
            raise APIError(400, f"adapter '{load.lora_name}': {exc.message}", param=exc.param,
                           code=exc.code) from None
    try:
        future = engine.add_adapter(load.lora_name, path, pin=load.pin, wait=False)
        info = await asyncio.wrap_future(future)
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path", code=worker_api.ADAPTER_INVALID) from None
    except ValueError as exc:  # e.g. pinning more than max_loras - 1
        raise APIError(400, str(exc), param="pin" if load.pin else "lora_path") from None
    return {"object": "adapter", **adapter_json(info)}


def _fetch_settings(request: Request) -> FetchSettings:
    """The app's (read at start-up by the CLI), else from the environment once per app."""
    settings = getattr(request.app.state, "fetch_settings", None)
    if settings is None:
        try:
            settings = FetchSettings.from_env()
        except ValueError as exc:
            raise APIError(500, f"adapter cache settings: {exc}", type="internal_server_error") from None
        request.app.state.fetch_settings = settings
    return settings


@runtime_router.post(worker_api.UNLOAD_ADAPTER)
async def unload_lora_adapter(body: UnloadAdapterRequest, request: Request) -> dict:
    engine = _engine(request)
    try:
        await asyncio.to_thread(engine.remove_adapter, body.lora_name)
    except LookupError:
        raise _not_found(body.lora_name) from None
    return {"object": "adapter", "name": body.lora_name, "deleted": True}


async def _pin(request: Request, name: str, pinned: bool) -> dict:
    engine = _engine(request)
    try:
        await asyncio.to_thread(engine.pin_adapter, name, pinned)
    except LookupError:
        raise _not_found(name) from None
    except ValueError as exc:
        raise APIError(400, str(exc), param="name", code=worker_api.TOO_MANY_PINNED) from None
    info = next((a for a in engine.list_adapters() if a.name == name), None)
    if info is None:
        raise _not_found(name)
    return {"object": "adapter", **adapter_json(info)}


@router.post(worker_api.PIN_ADAPTER)
async def pin_adapter(name: str, request: Request) -> dict:
    return await _pin(request, name, True)


@router.post(worker_api.UNPIN_ADAPTER)
async def unpin_adapter(name: str, request: Request) -> dict:
    return await _pin(request, name, False)


@router.get(worker_api.ADAPTERS)
async def list_adapters(request: Request) -> dict:
    engine = _engine(request)
    return {"object": "list", "data": [adapter_json(a) for a in engine.list_adapters()]}

"""The FastAPI app: routes, start-up (the engine thread loads the model after the server
binds) and shut-down. Build it with `create_app(ServerSettings(...))`; `cli.py` runs it.

The routes here read what they need from `request.app.state` (the Serving front, the settings,
the metrics), as the adapter routes (adapters.py) do; `create_app` only wires the parts.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference.config import AccessConfig, EngineConfig
from inference.server import errors
from inference.server.adapters import disabled_runtime_router, runtime_router
from inference.server.adapters import router as adapter_router
from inference.server.async_engine import AsyncEngine
from inference.server.auth import ApiKeyMiddleware
from inference.server.chat import create_chat_completion
from inference.server.completions import create_completion
from inference.server.fetch import FetchSettings
from inference.server.metrics import ServerMetrics
from inference.server.protocol import ChatCompletionRequest, CompletionRequest
from inference.server.serving import Serving
from protocol import worker_api
from protocol.worker_api import BaseModelInfo

log = logging.getLogger("inference.server")


@dataclass
class ServerSettings:
    config: EngineConfig
    served_model_names: list[str] = field(default_factory=list)  # empty: the model's own name
    lora_modules: dict[str, str] = field(default_factory=dict)  # registered at start-up
    max_waiting_requests: int = 256
    # The admin token and the portal origins adapters may be fetched from (default: open routes, no fetch).
    access: AccessConfig = field(default_factory=AccessConfig)
    fetch: FetchSettings | None = None  # None: read from the environment at the first fetch


def create_app(settings: ServerSettings, on_engine_dead: Callable[[BaseException], None] | None = None) -> FastAPI:
    served_names = list(settings.served_model_names)  # filled with the model's own name once loaded
    # The metrics see every output (on the event loop); they are built next, before the engine starts.
    engine = AsyncEngine(_engine_factory(settings, served_names, on_loaded=lambda llm: metrics.engine_loaded(llm)),
                         on_output=lambda o, s: metrics.on_output(o, s))
    metrics = ServerMetrics(engine, model_name=lambda: served_names[0] if served_names else "")
    serving = Serving(
        engine, served_names=served_names,
        capacity=lambda: settings.config.max_num_seqs + settings.max_waiting_requests,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(on_dead=on_engine_dead)
        yield
        engine.shutdown()

    app = FastAPI(title="loraplex inference worker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.settings = settings
    app.state.admin_token = settings.access.admin_token
    app.state.portal_origins = settings.access.portal_origins
    app.state.fetch_settings = settings.fetch
    app.state.metrics = metrics
    app.state.started_at = int(time.time())  # the `created` of what /v1/models lists: when this worker started
    errors.install(app)
    app.include_router(router)
    app.include_router(adapter_router)
    app.include_router(runtime_router if settings.access.allow_runtime_lora_updating else disabled_runtime_router)
    if settings.access.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.access.api_key, admin_token=settings.access.admin_token)
    return app


def _engine_factory(settings: ServerSettings, served_names: list[str],
                    on_loaded: Callable[[object], None]) -> Callable[[], object]:
    """What the engine thread runs first: load the model and the start-up adapters, then
    on_loaded(engine) (the metrics that need the model's limits)."""

    def load():
        # Imported on the engine thread, after the server bound (/health answers meanwhile): the
        # engine's chain (torch, loaders, tokenizers) costs ~1.3 s on a 2-core box (python -X
        # importtime), which the worker no longer pays before it binds.
        from inference.engine.llm_engine import LLMEngine

        start = time.perf_counter()
        print(f"loading model {settings.config.model_path} ({settings.config.dtype}, {settings.config.device})",
              file=sys.stderr, flush=True)
        engine = LLMEngine(settings.config, progress=True)
        for name, path in settings.lora_modules.items():
            info = engine.add_adapter(name, path)
            print(f"adapter {name}: {path} (rank {info.rank})", file=sys.stderr, flush=True)
        if not served_names:
            served_names.append(engine.model_name)
        on_loaded(engine)
        print(f"model loaded in {time.perf_counter() - start:.1f}s; serving as {', '.join(served_names)}",
              file=sys.stderr, flush=True)
        return engine

    return load


router = APIRouter()


def _serving(request: Request) -> Serving:
    return request.app.state.serving


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: the process and its engine thread are alive (while loading too)."""
    engine = _serving(request).engine
    if engine.error is not None:
        return JSONResponse({"status": "dead", "error": str(engine.error)}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness: 200 once the model is loaded and requests can be served; 503 again while
    draining after SIGTERM (drain.py), so no one sends more."""
    serving = _serving(request)
    engine = serving.engine
    if engine.error is not None:
        return JSONResponse({"status": "dead", "error": str(engine.error)}, status_code=503)
    if serving.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    if not engine.ready.is_set():
        return JSONResponse({"status": "loading"}, status_code=503)
    return JSONResponse({"status": "ready", "model": serving.served_names[0]})


@router.get("/v1/models")
async def models(request: Request) -> dict:
    """The base model under each served name, then every registered adapter (parent: the base)."""
    serving = _serving(request)
    serving.check_ready()
    llm = serving.engine.engine
    settings: ServerSettings = request.app.state.settings
    created = request.app.state.started_at
    base = serving.served_names[0]
    data = [{"id": name, "object": "model", "created": created, "owned_by": "loraplex",
             "root": str(settings.config.model), "parent": None, "max_model_len": llm.max_model_len}
            for name in serving.served_names]
    data += [{"id": a.name, "object": "model", "created": created, "owned_by": "loraplex",
              "root": str(a.path), "parent": base, "max_model_len": llm.max_model_len}
             for a in llm.list_adapters()]
    return {"object": "list", "data": data}


@router.get(worker_api.BASE_MODEL)
async def base_model(request: Request) -> dict:
    """The base's shapes and the adapter limits: what an adapter must match to load here
    (the portal validates uploads against it before staging them)."""
    serving = _serving(request)
    serving.check_ready()
    llm = serving.engine.engine
    config: EngineConfig = request.app.state.settings.config
    c = llm.model_config
    return BaseModelInfo(
        name=serving.served_names[0], checkpoint_name=c.name, num_hidden_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, vocab_size=c.vocab_size,
        max_model_len=llm.max_model_len, dtype=config.dtype, max_loras=config.max_loras,
        max_cpu_loras=config.max_cpu_loras, max_lora_rank=config.max_lora_rank,
        matmul_plan=llm.matmul_plan.describe(),
    ).to_json()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await create_chat_completion(_serving(request), body, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await create_completion(_serving(request), body, request)


@router.get("/metrics")
async def prometheus(request: Request) -> Response:
    metrics: ServerMetrics = request.app.state.metrics
    return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

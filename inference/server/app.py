"""The FastAPI app: routes, start-up (the engine thread loads the model after the server
binds) and shut-down. Build it with `create_app(ServerSettings(...))`; `cli.py` runs it."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference.config import AccessConfig, EngineConfig
from inference.server import errors
from inference.server.adapters import router as adapter_router
from inference.server.async_engine import AsyncEngine
from inference.server.chat import create_chat_completion
from inference.server.completions import create_completion
from inference.server.fetch import FetchSettings
from inference.server.metrics import ServerMetrics
from inference.server.protocol import ChatCompletionRequest, CompletionRequest
from inference.server.serving import Serving

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


def _load_engine(settings: ServerSettings, served_names: list[str]) -> Callable[[], object]:
    def load():
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
        print(f"model loaded in {time.perf_counter() - start:.1f}s; serving as {', '.join(served_names)}",
              file=sys.stderr, flush=True)
        return engine

    return load


def create_app(settings: ServerSettings, on_engine_dead: Callable[[BaseException], None] | None = None) -> FastAPI:
    served_names = list(settings.served_model_names)
    metrics_ref: list[ServerMetrics] = []
    engine = AsyncEngine(_load_engine(settings, served_names), on_output=lambda o, s: metrics_ref[0].on_output(o, s))
    metrics = ServerMetrics(engine, model_name=lambda: served_names[0] if served_names else "")
    metrics_ref.append(metrics)
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
    app.state.admin_token = settings.access.admin_token
    app.state.portal_origins = settings.access.portal_origins
    app.state.fetch_settings = settings.fetch
    app.state.metrics = metrics
    errors.install(app)
    app.include_router(adapter_router)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the process and its engine thread are alive (while loading too)."""
        if engine.error is not None:
            return JSONResponse({"status": "dead", "error": str(engine.error)}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 once the model is loaded and requests can be served."""
        if engine.error is not None:
            return JSONResponse({"status": "dead", "error": str(engine.error)}, status_code=503)
        if not engine.ready.is_set():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready", "model": served_names[0]})

    @app.get("/v1/models")
    async def models() -> dict:
        serving.check_ready()
        llm = engine.engine
        created = int(time.time())
        base = served_names[0]
        data = [{"id": name, "object": "model", "created": created, "owned_by": "loraplex",
                 "root": str(settings.config.model), "parent": None, "max_model_len": llm.max_model_len}
                for name in served_names]
        data += [{"id": a.name, "object": "model", "created": created, "owned_by": "loraplex",
                  "root": str(a.path), "parent": base, "max_model_len": llm.max_model_len}
                 for a in llm.list_adapters()]
        return {"object": "list", "data": data}

    @app.get("/v1/base_model")
    async def base_model() -> dict:
        """The base's shapes and the adapter limits: what an adapter must match to load here
        (the portal validates uploads against it before staging them)."""
        serving.check_ready()
        llm = engine.engine
        c = llm.model_config
        return {
            "name": served_names[0],
            "checkpoint_name": c.name,
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "vocab_size": c.vocab_size,
            "max_model_len": llm.max_model_len,
            "dtype": settings.config.dtype,
            "max_loras": settings.config.max_loras,
            "max_cpu_loras": settings.config.max_cpu_loras,
            "max_lora_rank": settings.config.max_lora_rank,
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, body, request)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app

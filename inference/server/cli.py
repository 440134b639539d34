"""`python -m inference serve`: flags (vLLM's names), the engine config, and uvicorn.

Flags override INFERENCE_* variables (EngineConfig.from_env, AccessConfig.from_env). A bad flag
or value prints one line and exits 2 before anything loads (so does INFERENCE_ENV=production
without an admin token of at least 32 characters); the HTTP server binds first and the model loads
behind it (progress on stderr), so /health answers at once and /ready turns 200 when loaded.
If the model fails to load the process exits 1. SIGTERM drains (drain.py): /ready turns 503, new
requests are refused, in-flight ones finish within --shutdown-grace-seconds, then the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from inference.config import AccessConfig, ConfigError, EngineConfig

DEFAULT_PORT = 8001
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30.0


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", help="a .gguf file or an HF checkpoint directory (default: the fetched SmolLM2)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the base model's name(s) in the API (default: the model's own name); the first is listed")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: the API has no auth)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"])
    p.add_argument("--device", help="cpu or cuda[:N]")
    p.add_argument("--max-num-seqs", type=int, help="sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per engine step")
    p.add_argument("--max-model-len", type=int, help="cap on prompt + output tokens")
    p.add_argument("--kv-cache-memory", help="KV cache: bytes ('512MiB', '2GiB') or a fraction of free memory")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of prompt prefixes seen before, per adapter and cache_salt "
                        "(default on; env INFERENCE_ENABLE_PREFIX_CACHING)")
    p.add_argument("--max-loras", type=int, help="adapters resident on the device at once")
    p.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory")
    p.add_argument("--max-lora-rank", type=int, help="largest adapter rank accepted")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters to register at start-up")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests that may wait beyond the running batch; more get 503 + Retry-After")
    p.add_argument("--admin-token",
                   help="shared secret for the adapter routes (env INFERENCE_ADMIN_TOKEN); unset: open "
                        "(refused when INFERENCE_ENV=production)")
    p.add_argument("--portal-origins", metavar="ORIGINS",
                   help="comma-separated origins (scheme://host[:port]) a load's lora_url may point at "
                        "(env INFERENCE_PORTAL_ORIGINS); unset: nothing is fetched by URL")
    p.add_argument("--shutdown-grace-seconds", metavar="SECONDS",
                   help="on SIGTERM: stop admitting, let in-flight requests finish for up to this long, "
                        "then cut the rest and exit (env INFERENCE_SHUTDOWN_GRACE_SECONDS; default 30)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _lora_modules(items: list[str]) -> dict[str, str]:
    modules: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError("--lora-modules", f"expected NAME=PATH, got {item!r}")
        if name in modules:
            raise ConfigError("--lora-modules", f"adapter name {name!r} given twice")
        if not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError("--lora-modules", f"{name}: {path} is not a directory")
        modules[name] = os.path.expanduser(path)
    return modules


def engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {
        "model": args.model, "dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory, "enable_prefix_caching": args.enable_prefix_caching,
    }
    # The adapter fields only when given, so the flags stay optional on any engine version.
    for name in ("max_loras", "max_cpu_loras", "max_lora_rank"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    config = EngineConfig.from_env(**overrides)
    if not config.model_path.exists():
        hint = " (fetch the default model: python -m inference.models fetch)" if config.model_path.suffix == ".gguf" else ""
        raise ConfigError("model", f"{config.model_path} does not exist{hint}")
    return config


class QuietProbes(logging.Filter):
    """Drops access-log lines of successful probes (the fleet poll and Prometheus hit these
    every few seconds); failed probes and every other route are still logged."""

    PATHS = frozenset({"/ready", "/health", "/metrics", "/v1/base_model"})

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:  # uvicorn: (client, method, path, http, status)
            path, status = str(args[2]).split("?", 1)[0], args[4]
            return not (path in self.PATHS and isinstance(status, int) and status < 400)
        return True


def shutdown_grace(args: argparse.Namespace) -> float:
    """--shutdown-grace-seconds, else INFERENCE_SHUTDOWN_GRACE_SECONDS, else 30: seconds >= 0
    (0: whatever runs is cut at once)."""
    variable, value = "--shutdown-grace-seconds", args.shutdown_grace_seconds
    if value is None:
        variable, value = "INFERENCE_SHUTDOWN_GRACE_SECONDS", os.environ.get("INFERENCE_SHUTDOWN_GRACE_SECONDS", "")
        if not value.strip():
            return DEFAULT_SHUTDOWN_GRACE_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ConfigError(variable, f"expected a number of seconds, got {value!r}") from None
    if not 0 <= seconds < float("inf"):
        raise ConfigError(variable, f"must be a finite number >= 0, got {value!r}")
    return seconds


def serve(args: argparse.Namespace) -> int:
    # Imported only to serve: uvicorn, FastAPI and the app's modules cost ~1.5 s (measured with
    # python -X importtime on a 2-core box), which `generate` and a bad flag (exit 2) don't pay.
    import uvicorn

    from inference.server.app import ServerSettings, create_app
    from inference.server.drain import DrainingServer
    from inference.server.fetch import FetchSettings

    if not 0 < args.port < 65536:
        raise ConfigError("--port", f"must be in 1..65535, got {args.port}")
    if args.max_waiting_requests < 0:
        raise ConfigError("--max-waiting-requests", f"must be >= 0, got {args.max_waiting_requests}")
    grace = shutdown_grace(args)
    access = AccessConfig.from_env(admin_token=args.admin_token, portal_origins=args.portal_origins)
    try:
        fetch = FetchSettings.from_env()
    except ValueError as exc:  # "INFERENCE_ADAPTER_MAX_BYTES: reason"
        variable, _, reason = str(exc).partition(": ")
        raise ConfigError(variable, reason) from None
    settings = ServerSettings(
        config=engine_config(args),
        served_model_names=args.served_model_name or [],
        lora_modules=_lora_modules(args.lora_modules),
        max_waiting_requests=args.max_waiting_requests,
        access=access,
        fetch=fetch,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    if access.admin_token is None:
        logging.getLogger("inference.server").warning(
            "no admin token: anyone who reaches this port may load and unload adapters "
            "(set INFERENCE_ADMIN_TOKEN; INFERENCE_ENV=production requires it)")
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None

    def on_engine_dead(exc: BaseException) -> None:
        # The engine cannot serve anything now: stop, and let the supervisor restart us.
        print(f"error: the engine stopped: {exc}", file=sys.stderr, flush=True)
        failed.append(exc)
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_engine_dead=on_engine_dead)
    # SIGTERM drains (drain.py) for up to `grace`; the 5 s is uvicorn's wait for connections
    # after that (and after Ctrl-C) before it cancels them.
    server = DrainingServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_graceful_shutdown=5),
                            serving=app.state.serving, grace_seconds=grace)
    server.run()
    return 1 if failed or not server.started else 0

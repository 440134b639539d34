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
import json
import logging
import os
import sys
from dataclasses import MISSING, fields

from inference.config import AccessConfig, ConfigError, EngineConfig, parse_memory

SERVE_DESCRIPTION = """\
Serve one base model and its LoRA adapters over the OpenAI API (/v1/chat/completions,
/v1/completions, /v1/models), like `vllm serve MODEL`, with vLLM's flag names.

Every flag overrides the INFERENCE_* variable named in its help; a bad value prints one line
and exits 2 before anything loads. The server binds first and loads the model behind it:
/health answers at once, /ready turns 200 once the model is loaded, /metrics is Prometheus
text with vLLM's metric names. Adapters are loaded and unloaded at run time
(/v1/load_lora_adapter, /v1/unload_lora_adapter) only with
INFERENCE_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING.
SIGTERM drains: in-flight requests finish within --shutdown-grace-seconds, then it exits 0.

example:
  python -m inference serve models/SmolLM2-135M-Instruct.Q4_1.gguf --port 8001 \\
      --api-key "$KEY" --lora-modules support-bot=/path/to/peft-adapter
"""
DEFAULT_PORT = 8001
DEFAULT_SHUTDOWN_GRACE_SECONDS = 30.0


_ENGINE_DEFAULTS = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}


def flag_help(text: str, *, default: object = None, env: str | None = None) -> str:
    """`text [default: X; env: VAR]`: what --help shows for every flag (argparse %-formats help)."""
    parts = ([f"default: {default}"] if default is not None else []) + ([f"env: {env}"] if env else [])
    return (f"{text} [{'; '.join(parts)}]" if parts else text).replace("%", "%%")


def engine_flag_help(text: str, field: str, default: object = None) -> str:
    """Help for a flag over EngineConfig.<field>: its default and its INFERENCE_<FIELD> variable."""
    return flag_help(text, default=_ENGINE_DEFAULTS.get(field) if default is None else default,
                     env=f"INFERENCE_{field.upper()}")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API (like `vllm serve`)",
                       description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help=flag_help("the model, as `vllm serve MODEL` takes it: a .gguf file or an HF checkpoint "
                                  "directory (same as --model)", default="the fetched SmolLM2", env="INFERENCE_MODEL"))
    p.add_argument("--model", help=flag_help("a .gguf file or an HF checkpoint directory",
                                             default="the fetched SmolLM2", env="INFERENCE_MODEL"))
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help=flag_help("the base model's name(s) in the API; the first is listed",
                                  default="the model's own name"))
    p.add_argument("--host", default="127.0.0.1",
                   help=flag_help("address to bind (keep it internal, or set --api-key)", default="127.0.0.1"))
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=flag_help("port to bind", default=DEFAULT_PORT))
    p.add_argument("--api-key", metavar="KEY",
                   help=flag_help("every route but /health, /ready and /metrics then needs 'Authorization: Bearer "
                                  "KEY' (vLLM's --api-key / VLLM_API_KEY)", default="none: open",
                                  env="INFERENCE_API_KEY"))
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help=engine_flag_help("weights and activations", "dtype"))
    p.add_argument("--weights-dtype", choices=["auto", "int8", "int4"],
                   help=engine_flag_help("auto: dense weights in --dtype; int8 / int4: weight-only quantised "
                                         "projections (CPU; int4 takes a GGUF file's 4-bit blocks as they are)",
                                         "weights_dtype"))
    p.add_argument("--matmul-path", choices=["auto", "native", "fp32-upcast", "fp32-cached"],
                   help=engine_flag_help("how bf16/fp16 products run on the CPU: auto measures the three paths "
                                         "at start-up and takes the fastest per shape class (decode, batched "
                                         "decode, prefill); native / fp32-upcast / fp32-cached forces one",
                                         "matmul_path"))
    p.add_argument("--lora-kernel", choices=["auto", "fused", "amx", "torch"],
                   help=engine_flag_help("the LoRA delta's kernel on the CPU: auto times the fused C++ kernel "
                                         "(built for this CPU on first use) against torch ops at start-up, and "
                                         "where the CPU has AMX, from how many tokens of one adapter its tile "
                                         "products win; fused / amx (every run of tokens on tiles) / torch "
                                         "forces one", "lora_kernel"))
    p.add_argument("--attention-kernel", choices=["auto", "fused", "torch"],
                   help=engine_flag_help("how decode rows and prefill chunks attend on the CPU: auto times "
                                         "the fused C++ paged kernels (built with the LoRA one) against torch's "
                                         "SDPA at start-up, for each apart; fused / torch forces both",
                                         "attention_kernel"))
    p.add_argument("--quant-kernel", choices=["auto", "fused", "torch"],
                   help=engine_flag_help("what multiplies --weights-dtype int8/int4 weights on the CPU: auto "
                                         "times the fused C++ kernel (int8 activations, built with the LoRA "
                                         "one) against torch's at start-up; fused / torch forces one",
                                         "quant_kernel"))
    p.add_argument("--dense-layout", choices=["auto", "onednn", "plain"],
                   help=engine_flag_help("how dense bf16/fp16 weights lie on the CPU: auto times oneDNN's "
                                         "prepacked layout (no per-call reorder) against the plain one at "
                                         "start-up; onednn / plain forces one", "dense_layout"))
    p.add_argument("--device", help=engine_flag_help("cpu or cuda[:N]", "device"))
    p.add_argument("--max-num-seqs", type=int, help=engine_flag_help("sequences in one batch", "max_num_seqs"))
    p.add_argument("--max-num-batched-tokens", type=int,
                   help=engine_flag_help("tokens per engine step", "max_num_batched_tokens"))
    p.add_argument("--max-model-len", type=int,
                   help=engine_flag_help("cap on prompt + output tokens", "max_model_len",
                                         default="the model's context length"))
    p.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                   help=flag_help("the KV cache takes this fraction of the memory free once the weights are "
                                  "loaded, (0, 0.95] (vLLM's flag; vLLM counts the weights in the fraction)",
                                  default="unset: the 1GiB below", env="INFERENCE_KV_CACHE_MEMORY"))
    p.add_argument("--kv-cache-memory-bytes", metavar="BYTES",
                   help=flag_help("the KV cache's size in bytes ('2147483648', '512MiB', '2GiB'); give one of "
                                  "the three KV cache flags", default="1GiB", env="INFERENCE_KV_CACHE_MEMORY"))
    p.add_argument("--kv-cache-memory", metavar="BYTES_OR_FRACTION",
                   help=flag_help("our older spelling of both: bytes ('512MiB') or a fraction of free memory "
                                  "('0.3')", default="1GiB", env="INFERENCE_KV_CACHE_MEMORY"))
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help=engine_flag_help("reuse the KV of prompt prefixes seen before, per adapter and cache_salt",
                                         "enable_prefix_caching", default="on"))
    p.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=None,
                   help=flag_help("serve LoRA adapters (vLLM's flag; on here: a multi-LoRA worker); "
                                  "--no-enable-lora serves the base alone", default="on",
                                  env="INFERENCE_MAX_LORAS=0 turns it off"))
    p.add_argument("--max-loras", type=int, help=engine_flag_help("adapters resident on the device at once", "max_loras"))
    p.add_argument("--max-cpu-loras", type=int, help=engine_flag_help("adapters kept in host memory", "max_cpu_loras"))
    p.add_argument("--max-lora-rank", type=int, help=engine_flag_help("largest adapter rank accepted", "max_lora_rank"))
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help=flag_help("adapters to register at start-up: NAME=PATH or vLLM's JSON "
                                  "'{\"name\": NAME, \"path\": PATH}'", default="none"))
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help=flag_help("requests that may wait beyond the running batch; more get 503 + Retry-After",
                                  default=256))
    p.add_argument("--admin-token",
                   help=flag_help("shared secret for the adapter routes; unset: open (refused when "
                                  "INFERENCE_ENV=production)", default="none", env="INFERENCE_ADMIN_TOKEN"))
    p.add_argument("--portal-origins", metavar="ORIGINS",
                   help=flag_help("comma-separated origins (scheme://host[:port]) a load's lora_url may point at; "
                                  "unset: nothing is fetched by URL", default="none", env="INFERENCE_PORTAL_ORIGINS"))
    p.add_argument("--shutdown-grace-seconds", metavar="SECONDS",
                   help=flag_help("on SIGTERM: stop admitting, let in-flight requests finish for up to this long, "
                                  "then cut the rest and exit", default=f"{DEFAULT_SHUTDOWN_GRACE_SECONDS:g}",
                                  env="INFERENCE_SHUTDOWN_GRACE_SECONDS"))
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help=flag_help("server log level", default="info"))


def _lora_modules(items: list[str], *, enabled: bool = True) -> dict[str, str]:
    modules: dict[str, str] = {}
    if items and not enabled:
        raise ConfigError("--lora-modules", "adapters need LoRA on (drop --no-enable-lora, or set --max-loras >= 1)")
    for item in items:
        if item.lstrip().startswith("{"):  # vLLM's JSON form; base_model_name is not needed here
            try:
                spec = json.loads(item)
            except ValueError:
                raise ConfigError("--lora-modules", f"not valid JSON: {item!r}") from None
            name, path = (spec.get("name"), spec.get("path")) if isinstance(spec, dict) else (None, None)
            if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
                raise ConfigError("--lora-modules", f"expected {{\"name\": ..., \"path\": ...}}, got {item!r}")
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ConfigError("--lora-modules", f"expected NAME=PATH, got {item!r}")
        if name in modules:
            raise ConfigError("--lora-modules", f"adapter name {name!r} given twice")
        if not os.path.isdir(os.path.expanduser(path)):
            raise ConfigError("--lora-modules", f"{name}: {path} is not a directory")
        modules[name] = os.path.expanduser(path)
    return modules


def model_argument(args: argparse.Namespace) -> str | None:
    """The model from `serve MODEL` or `--model` (both given: they must agree)."""
    positional, flag = getattr(args, "model_tag", None), args.model
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError("--model", f"the model is given twice and differently: {positional!r} (positional) "
                                     f"and {flag!r} (--model); give one")
    return positional if positional is not None else flag


def kv_cache_memory(args: argparse.Namespace) -> int | float | None:
    """--gpu-memory-utilization (a fraction), --kv-cache-memory-bytes (bytes) or --kv-cache-memory
    (either): at most one of them."""
    given = [(name, value) for name, value in (
        ("--gpu-memory-utilization", getattr(args, "gpu_memory_utilization", None)),
        ("--kv-cache-memory-bytes", getattr(args, "kv_cache_memory_bytes", None)),
        ("--kv-cache-memory", args.kv_cache_memory)) if value is not None]
    if len(given) > 1:
        raise ConfigError(given[1][0], f"give one of {', '.join(name for name, _ in given)}: they set the same "
                                       "KV cache size")
    if not given:
        return None
    name, value = given[0]
    if name == "--gpu-memory-utilization":
        if not 0 < value <= 0.95:
            raise ConfigError(name, f"a fraction of free memory must be in (0, 0.95], got {value}")
        return float(value)
    size = parse_memory(name, value)
    if name == "--kv-cache-memory-bytes" and not isinstance(size, int):
        raise ConfigError(name, f"expected bytes like '2147483648' or '2GiB' (a fraction is "
                                f"--gpu-memory-utilization), got {value!r}")
    return size


def engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {
        "model": model_argument(args), "dtype": args.dtype, "weights_dtype": args.weights_dtype,
        "matmul_path": args.matmul_path, "lora_kernel": args.lora_kernel,
        "attention_kernel": args.attention_kernel, "quant_kernel": args.quant_kernel,
        "dense_layout": args.dense_layout, "device": args.device, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "kv_cache_memory": kv_cache_memory(args), "enable_prefix_caching": args.enable_prefix_caching,
    }
    # The adapter fields only when given, so the flags stay optional on any engine version.
    for name in ("max_loras", "max_cpu_loras", "max_lora_rank"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.enable_lora is False:
        if args.max_loras:
            raise ConfigError("--no-enable-lora", f"contradicts --max-loras {args.max_loras}")
        overrides["max_loras"] = 0
    config = EngineConfig.from_env(**overrides)
    if args.enable_lora and config.max_loras == 0:
        raise ConfigError("--enable-lora", "needs at least one adapter slot (--max-loras >= 1; INFERENCE_MAX_LORAS is 0)")
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
    access = AccessConfig.from_env(admin_token=args.admin_token, portal_origins=args.portal_origins,
                                   api_key=args.api_key)
    try:
        fetch = FetchSettings.from_env()
    except ValueError as exc:  # "INFERENCE_ADAPTER_MAX_BYTES: reason"
        variable, _, reason = str(exc).partition(": ")
        raise ConfigError(variable, reason) from None
    settings = ServerSettings(
        config=engine_config(args),
        served_model_names=args.served_model_name or [],
        lora_modules=_lora_modules(args.lora_modules, enabled=args.enable_lora is not False),
        max_waiting_requests=args.max_waiting_requests,
        access=access,
        fetch=fetch,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("uvicorn.access").addFilter(QuietProbes())
    if access.allow_runtime_lora_updating:
        logging.getLogger("inference.server").info(
            "INFERENCE_ALLOW_RUNTIME_LORA_UPDATING: adapters may be loaded and unloaded at run time")
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

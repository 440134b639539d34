"""The inference process's configuration: one typed dataclass, every field from the
environment (INFERENCE_*) with a safe default, command-line flags on top.

Bad values raise `ConfigError` naming the variable; the CLI prints that one line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from inference.models.fetch import default_model_path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("bfloat16", "float32", "float16")
# auto: dense weights in `dtype` (today's path); int8 / int4: weight-only quantised projections
# for CPU decode (inference/models/quantize.py), activations stay in `dtype`.
WEIGHTS_DTYPES = ("auto", "int8", "int4")

# inference/layers/matmul_plan.py's paths, named here so reading the config never imports torch
MATMUL_PATH_CHOICES = ("auto", "native", "fp32-upcast", "fp32-cached")
LORA_KERNEL_CHOICES = ("auto", "fused", "amx", "torch")
ATTENTION_KERNEL_CHOICES = ("auto", "fused", "torch")
QUANT_KERNEL_CHOICES = ("auto", "fused", "torch")
DENSE_LAYOUT_CHOICES = ("auto", "onednn", "plain")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class ConfigError(ValueError):
    def __init__(self, variable: str, message: str) -> None:
        super().__init__(f"{variable}: {message}")
        self.variable = variable


def parse_memory(variable: str, value: str | int | float) -> int | float:
    """`"1GiB"`, `"512MiB"`, `1073741824` → bytes (int); `"0.25"` → a fraction (float) of free memory."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        text = str(value)
    else:
        text = str(value).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(variable, f"expected bytes like '1GiB', '512MiB' or a fraction like '0.3', got {value!r}")
    number, unit = float(m.group(1)), m.group(2).lower()
    if unit == "" and "." in m.group(1):
        if not 0 < number <= 0.95:
            raise ConfigError(variable, f"a fraction of free memory must be in (0, 0.95], got {value!r}")
        return number
    size = int(number * _UNITS[unit])
    if size < 1 << 20:
        raise ConfigError(variable, f"at least 1MiB is needed, got {value!r}")
    return size


def _parse_int(variable: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(variable, f"expected an integer, got {value!r}") from None
    if number < minimum:
        raise ConfigError(variable, f"must be >= {minimum}, got {number}")
    return number


def _parse_bool(variable: str, value: str) -> bool:
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(variable, f"expected true/false, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    # A .gguf file or an HF checkpoint directory; default: the fetched SmolLM2 (MODELS_DIR).
    model: str = field(default_factory=lambda: str(default_model_path()))
    dtype: str = "bfloat16"  # bf16 is the CPU default: about 2x fp32 throughput
    weights_dtype: str = "auto"  # one of WEIGHTS_DTYPES
    # How bf16/fp16 products run on the CPU (inference/layers/matmul_plan.py): "auto" measures
    # native vs fp32-upcast vs fp32-cached at start-up per shape class; a path name forces it.
    matmul_path: str = "auto"
    # The LoRA delta's kernel on the CPU: "auto" times the fused C++ kernel (kernels/cpu_fused.py,
    # built for this CPU) against torch ops at start-up; "fused" / "torch" forces one.
    lora_kernel: str = "auto"
    # How decode rows and prefill chunks attend on the CPU (inference/layers/attention_plan.py):
    # "auto" times the fused C++ paged kernels against torch's SDPA at start-up, for each apart;
    # "fused" / "torch" forces both.
    attention_kernel: str = "auto"
    # What multiplies int8/int4 weights on the CPU (inference/layers/quant_plan.py): "auto" times
    # the fused C++ kernel (int8 activations) against torch's at start-up; "fused" / "torch" forces one.
    quant_kernel: str = "auto"
    # How dense bf16/fp16 weights lie on the CPU (inference/layers/dense_layout.py): "auto" times
    # oneDNN's prepacked layout against the plain one at start-up; "onednn" / "plain" forces one.
    dense_layout: str = "auto"
    device: str = "cpu"
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's context length
    block_size: int = 16
    kv_cache_memory: int | float = 1 << 30  # bytes, or a fraction of free memory
    enable_chunked_prefill: bool = True
    # Reuse the KV of full blocks a request shares with an earlier one (same tokens, adapter id
    # and cache_salt) instead of recomputing it; vLLM's automatic prefix caching.
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None: torch's default
    # Multi-LoRA: device slots (adapters in one step at most; 0 disables LoRA), host-tier
    # entries (>= max_loras), the widest rank a slot holds, and whether an adapter whose
    # base_model_name_or_path cannot be verified is refused rather than accepted with a warning.
    max_loras: int = 4
    max_cpu_loras: int = 16
    max_lora_rank: int = 16
    strict_base_match: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.matmul_path not in MATMUL_PATH_CHOICES:
            raise ConfigError(
                "matmul_path", f"expected one of {', '.join(MATMUL_PATH_CHOICES)}, got {self.matmul_path!r}"
            )
        if self.lora_kernel not in LORA_KERNEL_CHOICES:
            raise ConfigError(
                "lora_kernel", f"expected one of {', '.join(LORA_KERNEL_CHOICES)}, got {self.lora_kernel!r}"
            )
        if self.attention_kernel not in ATTENTION_KERNEL_CHOICES:
            raise ConfigError(
                "attention_kernel",
                f"expected one of {', '.join(ATTENTION_KERNEL_CHOICES)}, got {self.attention_kernel!r}",
            )
        if self.quant_kernel not in QUANT_KERNEL_CHOICES:
            raise ConfigError(
                "quant_kernel", f"expected one of {', '.join(QUANT_KERNEL_CHOICES)}, got {self.quant_kernel!r}"
            )
        if self.dense_layout not in DENSE_LAYOUT_CHOICES:
            raise ConfigError(
                "dense_layout", f"expected one of {', '.join(DENSE_LAYOUT_CHOICES)}, got {self.dense_layout!r}"
            )
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ConfigError(
                "weights_dtype", f"expected one of {', '.join(WEIGHTS_DTYPES)}, got {self.weights_dtype!r}"
            )
        if self.weights_dtype != "auto" and self.device != "cpu":
            raise ConfigError(
                "weights_dtype", f"{self.weights_dtype} weights run on the CPU only, not {self.device!r}"
            )
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ConfigError("device", f"expected 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name, minimum in (("max_num_seqs", 1), ("max_num_batched_tokens", 16), ("block_size", 1)):
            if getattr(self, name) < minimum:
                raise ConfigError(name, f"must be >= {minimum}, got {getattr(self, name)}")
        if self.max_loras < 0:
            raise ConfigError("max_loras", f"must be >= 0 (0 disables LoRA), got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ConfigError("max_lora_rank", f"must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(
                "max_cpu_loras", f"must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2, got {self.max_model_len}")
        if isinstance(self.kv_cache_memory, str):
            object.__setattr__(self, "kv_cache_memory", parse_memory("kv_cache_memory", self.kv_cache_memory))

    @property
    def model_path(self) -> Path:
        # Relative paths resolve against the working directory, then the repository root.
        path = Path(self.model).expanduser()
        if not path.is_absolute() and not path.exists() and (ROOT / path).exists():
            return ROOT / path
        return path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object) -> EngineConfig:
        """Read INFERENCE_<FIELD> variables; keyword overrides (CLI flags) win when not None."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            var = f"INFERENCE_{f.name.upper()}"
            if var not in env or env[var] == "":
                continue
            raw = env[var]
            if f.name in ("model", "dtype", "weights_dtype", "matmul_path", "lora_kernel", "attention_kernel", "quant_kernel",
                          "dense_layout", "device"):
                values[f.name] = raw
            elif f.name == "kv_cache_memory":
                values[f.name] = parse_memory(var, raw)
            elif f.name in ("enable_chunked_prefill", "enable_prefix_caching", "strict_base_match"):
                values[f.name] = _parse_bool(var, raw)
            else:
                values[f.name] = _parse_int(var, raw, minimum=0 if f.name in ("seed", "max_loras") else 1)
        given = {k: v for k, v in overrides.items() if v is not None}
        from_env = set(values) - set(given)
        values.update(given)
        try:
            return cls(**values)
        except ConfigError as exc:
            if exc.variable in from_env:  # name the variable the user set
                message = str(exc).split(": ", 1)[1]
                raise ConfigError(f"INFERENCE_{exc.variable.upper()}", message) from None
            raise


# --- who may manage adapters, and where they may come from ------------------------------------

ENVIRONMENTS = ("development", "production")
MIN_ADMIN_TOKEN_CHARS = 32
_DEFAULT_PORTS = {"http": 80, "https": 443}


def url_origin(url: str) -> str:
    """The origin of an http(s) URL as `scheme://host:port`: scheme and host lower-cased, the
    default port written out (`HTTP://Portal.internal/x/` → `http://portal.internal:80`).

    Parsed by httpx, the library that fetches the URL, so the origin checked is the origin
    fetched. ValueError for another scheme, no host, a bad port, or credentials in the URL
    (`user:pass@host`: a fetch authenticates with its Bearer token, never with userinfo)."""
    import httpx  # here: the engine imports this module and never needs httpx (~0.1 s, python -X importtime)

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError) as exc:
        raise ValueError(f"not a valid URL ({exc})") from None
    scheme = parsed.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("only http:// and https:// URLs")
    if not parsed.host:
        raise ValueError("no host")
    if parsed.userinfo:
        raise ValueError("credentials (user:password@) are not allowed in the URL")
    port = _DEFAULT_PORTS[scheme] if parsed.port is None else parsed.port
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is out of range")
    host = parsed.host.lower()
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def parse_origins(variable: str, value: str) -> tuple[str, ...]:
    """`"http://portal:8000, https://Portal.example"` → normalized origins (see url_origin);
    an origin is scheme://host[:port] and nothing else (a trailing '/' is tolerated)."""
    origins: list[str] = []
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        scheme, sep, rest = item.partition("://")
        rest = rest[:-1] if rest.endswith("/") else rest
        if not sep or not rest or any(c in rest for c in "/?#@\\") or any(c.isspace() for c in item):
            raise ConfigError(variable, f"expected origins like 'http://portal:8000' (scheme://host[:port], "
                                        f"comma-separated), got {item!r}")
        try:
            origin = url_origin(f"{scheme}://{rest}/")
        except ValueError as exc:
            raise ConfigError(variable, f"{item!r}: {exc}") from None
        if origin not in origins:
            origins.append(origin)
    return tuple(origins)


@dataclass(frozen=True)
class AccessConfig:
    """Who may call the worker and manage its adapters (environment INFERENCE_*; flags on top):

    INFERENCE_ENV            development (default) | production: production refuses to start
                             without an admin token of at least MIN_ADMIN_TOKEN_CHARS characters
    INFERENCE_API_KEY        (--api-key; vLLM's VLLM_API_KEY) the Bearer token every route but
                             /health, /ready and /metrics requires; unset: open
    INFERENCE_ADMIN_TOKEN    (--admin-token) the Bearer token the adapter routes require; unset: open
    INFERENCE_PORTAL_ORIGINS (--portal-origins) comma-separated origins a `lora_url` may point at;
                             unset: no adapter is fetched by URL (local `lora_path` loads still work)
    INFERENCE_ALLOW_RUNTIME_LORA_UPDATING  (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) true: the
                             load/unload routes exist; false (default, as in vLLM): they are 404s
    """

    environment: str = "development"
    admin_token: str | None = None
    portal_origins: tuple[str, ...] = ()
    api_key: str | None = None
    allow_runtime_lora_updating: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, admin_token: str | None = None,
                 portal_origins: str | None = None, api_key: str | None = None) -> AccessConfig:
        """Flags (`admin_token`, `portal_origins`, `api_key`) win over their variables when not None."""
        env = os.environ if environ is None else environ
        environment = (env.get("INFERENCE_ENV") or "development").strip().lower()
        if environment not in ENVIRONMENTS:
            raise ConfigError("INFERENCE_ENV", f"expected one of {', '.join(ENVIRONMENTS)}, "
                                               f"got {env.get('INFERENCE_ENV')!r}")
        token_var = "--admin-token" if admin_token is not None else "INFERENCE_ADMIN_TOKEN"
        token = (admin_token if admin_token is not None else env.get("INFERENCE_ADMIN_TOKEN") or "").strip()
        if environment == "production":
            if not token:
                raise ConfigError("INFERENCE_ADMIN_TOKEN", "INFERENCE_ENV=production needs an admin token for the "
                                  "adapter routes (set INFERENCE_ADMIN_TOKEN or --admin-token, at least "
                                  f"{MIN_ADMIN_TOKEN_CHARS} random characters)")
            if len(token) < MIN_ADMIN_TOKEN_CHARS:
                raise ConfigError(token_var, f"INFERENCE_ENV=production needs at least {MIN_ADMIN_TOKEN_CHARS} "
                                             f"characters, got {len(token)}")
        origins_var = "--portal-origins" if portal_origins is not None else "INFERENCE_PORTAL_ORIGINS"
        origins_text = portal_origins if portal_origins is not None else env.get("INFERENCE_PORTAL_ORIGINS", "")
        key_var = "--api-key" if api_key is not None else "INFERENCE_API_KEY"
        key = (api_key if api_key is not None else env.get("INFERENCE_API_KEY") or "").strip()
        if api_key is not None and not key:
            raise ConfigError(key_var, "must not be empty")
        runtime = env.get("INFERENCE_ALLOW_RUNTIME_LORA_UPDATING", "")
        return cls(environment=environment, admin_token=token or None,
                   portal_origins=parse_origins(origins_var, origins_text), api_key=key or None,
                   allow_runtime_lora_updating=_parse_bool("INFERENCE_ALLOW_RUNTIME_LORA_UPDATING", runtime)
                   if runtime.strip() else False)

"""The HTTP wire between the portal and an inference worker, written once: the routes, the JSON
bodies both sides build and read, and the error codes one side sends and the other acts on.

    POST /v1/load_lora_adapter    LoadAdapterBody   an adapter by a local directory (lora_path,
                                                    vLLM's field) or by a URL the worker fetches
                                                    (lora_url + files {filename: sha256}, with
                                                    auth_token sent to that URL as a Bearer token)
    POST /v1/unload_lora_adapter  UnloadAdapterBody
    POST /v1/adapters/{name}/pin | unpin
    GET  /v1/base_model           BaseModelInfo     what an adapter must match to load there
    any error                     ErrorObject       OpenAI's {"error": {message, type, param, code}}
    completions (answer, usage    RequestReport     under REPORT_KEY: where the adapter was found, queue
    chunk)                                          time, time to first token, inter-token gap

The worker validates requests with its own pydantic schemas (inference/server) whose field names
and limits come from here; the portal's worker client (portal/fleet/client.py) builds its
bodies and parses the answers with these. Both sides also share which OpenAI parameters the
worker refuses (UNSUPPORTED_CHAT_FIELDS, ...).

Standard library only: both sides import it.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any
from urllib.parse import quote

# -- routes -----------------------------------------------------------------------------------
HEALTH = "/health"
READY = "/ready"
METRICS = "/metrics"
MODELS = "/v1/models"
BASE_MODEL = "/v1/base_model"
CHAT_COMPLETIONS = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LOAD_ADAPTER = "/v1/load_lora_adapter"
UNLOAD_ADAPTER = "/v1/unload_lora_adapter"
ADAPTERS = "/v1/adapters"
# Route templates ({name} is the adapter's lora_name): the worker declares them, the portal fills them.
PIN_ADAPTER = "/v1/adapters/{name}/pin"
UNPIN_ADAPTER = "/v1/adapters/{name}/unpin"


def pin_path(lora_name: str, *, pinned: bool) -> str:
    """The pin (pinned=True) or unpin route of one adapter, its name escaped as one path segment."""
    return (PIN_ADAPTER if pinned else UNPIN_ADAPTER).format(name=quote(lora_name, safe=""))


# -- error codes (ErrorObject.code) the other side acts on -----------------------------------
MODEL_NOT_FOUND = "model_not_found"  # a completion for a model the worker does not hold: load it
ADAPTER_NOT_FOUND = "adapter_not_found"  # unload/pin of an adapter that is not registered
ADAPTER_INVALID = "adapter_invalid"  # the adapter's files break the PEFT rules or the base's shapes
ADAPTER_FETCH_FAILED = "adapter_fetch_failed"  # lora_url could not be read (network, HTTP status)
ADAPTER_SOURCE_FORBIDDEN = (
    "adapter_source_forbidden"  # lora_url is not on one of the worker's portal origins
)
ADAPTER_CHECKSUM_MISMATCH = "adapter_checksum_mismatch"
ADAPTER_TOO_LARGE = "adapter_too_large"
TOO_MANY_PINNED = "too_many_pinned"
INVALID_ADMIN_TOKEN = "invalid_admin_token"
INVALID_API_KEY = "invalid_api_key"  # the worker runs with --api-key and the request lacks it (401)
# A load/unload on a worker started without INFERENCE_ALLOW_RUNTIME_LORA_UPDATING (404, as in vLLM).
RUNTIME_LORA_UPDATING_DISABLED = "runtime_lora_updating_disabled"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
# 503s a worker gives before a request starts: another worker should take it (the gateway moves on).
SERVER_OVERLOADED = "server_overloaded"  # its waiting queue is full
WORKER_DRAINING = "worker_draining"  # it received SIGTERM: finishing what it has, admitting nothing new
# Load refusals that say nothing about the adapter: the worker could not reach the portal, or may
# not fetch from it. Another worker (or a fixed configuration) may succeed; the tenant is not at fault.
WORKER_SIDE_LOAD_ERRORS = frozenset({ADAPTER_FETCH_FAILED, ADAPTER_SOURCE_FORBIDDEN})


class BodyError(ValueError):
    """A body that breaks the wire's rules; `param` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


# -- the OpenAI error object --------------------------------------------------------------------
@dataclass(frozen=True)
class ErrorObject:
    """{"error": {"message", "type", "param", "code"}}: what every failed call answers."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def to_json(self) -> dict:
        return {"error": asdict(self)}

    @classmethod
    def from_json(cls, value: Any) -> ErrorObject | None:
        """The error object in a decoded body, or None when the body is not one. Tolerant as a
        reader must be: a field of the wrong type is dropped (message and type become "",
        param and code None)."""
        if not isinstance(value, dict) or not isinstance(value.get("error"), dict):
            return None
        error = value["error"]
        message = error.get("message")
        return cls(
            message=message
            if isinstance(message, str)
            else ("" if message is None else str(message)),
            type=error["type"] if isinstance(error.get("type"), str) else "",
            param=error["param"] if isinstance(error.get("param"), str) else None,
            code=error["code"] if isinstance(error.get("code"), str) else None,
        )

    @classmethod
    def parse(cls, raw: bytes | str) -> ErrorObject | None:
        """The error object in a raw response body, or None (not JSON, or not an error)."""
        try:
            return cls.from_json(json.loads(raw))
        except (ValueError, UnicodeDecodeError):
            return None


# -- loading and unloading adapters --------------------------------------------------------------
LORA_NAME_MAX = 256
LORA_URL_MAX = 2000


@dataclass(frozen=True)
class LoadAdapterBody:
    """POST /v1/load_lora_adapter. Exactly one source: `lora_path` (a directory the worker can
    read) or `lora_url` with `files` {filename: sha256} (the worker fetches lora_url + filename
    and checks each digest); `auth_token` is sent to lora_url only. `pin`: never evict it.
    Checked when built (BodyError names the field), on either side of the wire."""

    lora_name: str
    lora_path: str | None = None
    lora_url: str | None = None
    files: dict[str, str] | None = None
    auth_token: str | None = None
    pin: bool = False

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)
        if self.lora_path is not None and not self.lora_path:
            raise BodyError("lora_path: expected a non-empty path", param="lora_path")
        if self.lora_url is not None and not 1 <= len(self.lora_url) <= LORA_URL_MAX:
            raise BodyError(f"lora_url: expected 1 to {LORA_URL_MAX} characters", param="lora_url")
        if (self.lora_path is None) == (self.lora_url is None):
            raise BodyError(
                "give exactly one of lora_path (a local directory) or lora_url (with files)",
                param="lora_path",
            )
        if self.lora_url is not None and self.files is None:
            raise BodyError("files: lora_url needs files {filename: sha256}", param="files")

    @classmethod
    def local(cls, *, lora_name: str, lora_path: str, pin: bool = False) -> LoadAdapterBody:
        return cls(lora_name=lora_name, lora_path=lora_path, pin=pin)

    @classmethod
    def fetched(
        cls,
        *,
        lora_name: str,
        lora_url: str,
        files: dict[str, str],
        auth_token: str | None = None,
        pin: bool = False,
    ) -> LoadAdapterBody:
        return cls(
            lora_name=lora_name,
            lora_url=lora_url,
            files=dict(files),
            auth_token=auth_token,
            pin=pin,
        )

    def to_json(self) -> dict:
        """The body as sent: unset fields and pin=False left out (vLLM's body is lora_name + lora_path)."""
        body: dict[str, Any] = {"lora_name": self.lora_name}
        for key in ("lora_path", "lora_url", "files", "auth_token"):
            value = getattr(self, key)
            if value is not None:
                body[key] = dict(value) if key == "files" else value
        if self.pin:
            body["pin"] = True
        return body


@dataclass(frozen=True)
class UnloadAdapterBody:
    """POST /v1/unload_lora_adapter."""

    lora_name: str

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)

    def to_json(self) -> dict:
        return {"lora_name": self.lora_name}


# The field names a worker's schema for these bodies must have (inference/server/protocol.py checks).
LOAD_ADAPTER_FIELDS = tuple(f.name for f in fields(LoadAdapterBody))
UNLOAD_ADAPTER_FIELDS = tuple(f.name for f in fields(UnloadAdapterBody))


def check_lora_name(name: Any) -> None:
    if not isinstance(name, str) or not 1 <= len(name) <= LORA_NAME_MAX:
        raise BodyError(
            f"lora_name: expected a string of 1 to {LORA_NAME_MAX} characters", param="lora_name"
        )


# -- the base model ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BaseModelInfo:
    """GET /v1/base_model: the served base's shapes (HF config.json names) and the worker's
    adapter limits. The five shape fields are what any reader needs; the rest may be absent."""

    name: str  # the served name (its id in /v1/models)
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    checkpoint_name: str | None = (
        None  # the checkpoint's own name (adapters' base_model_name_or_path)
    )
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    max_model_len: int | None = None
    dtype: str | None = None
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    max_lora_rank: int | None = None
    # How this worker's CPU runs bf16 products (inference/layers/matmul_plan.py describe()):
    # {"source", "paths": {shape class: path}, "lora_dtype", "cpu_capability", "timings_us"}
    matmul_plan: dict | None = None

    def to_json(self) -> dict:
        return {
            f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None
        }

    @classmethod
    def from_json(cls, value: Any) -> BaseModelInfo | None:
        """The description in a decoded body, or None when it is not one (a field missing or of
        the wrong type: a JSON integer for the counts, a string for the names)."""
        if not isinstance(value, dict):
            return None
        found: dict[str, Any] = {}
        for f in fields(cls):
            item = value.get(f.name)
            required = f.default is MISSING
            if item is None:
                if required:
                    return None
                continue
            if f.type.startswith("dict"):
                if not isinstance(item, dict):
                    return None
                found[f.name] = item
                continue
            wants_str = f.type.startswith(
                "str"
            )  # the annotation, a string under `from __future__ import annotations`
            if wants_str and not isinstance(item, str):
                return None
            if not wants_str and (not isinstance(item, int) or isinstance(item, bool) or item < 0):
                return None
            found[f.name] = item
        if not found["name"] or min(found[k] for k in _SHAPE_FIELDS) <= 0:
            return None
        return cls(**found)


_SHAPE_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")



# -- completions: the worker's report on one request ------------------------------------------------
# Beside OpenAI's fields, a worker's completion answer carries REPORT_KEY: {"adapter_tier", "queue_ms",
# "ttft_ms", "inter_token_ms"} (RequestReport) at the top level of a non-streamed answer and of the
# streamed usage chunk (the last chunk, with stream_options.include_usage), as vLLM adds fields of
# its own. A plain OpenAI client ignores it; the gateway reads it into its usage ledger and removes
# it before its client sees the body.
REPORT_KEY = "loraplex"
# Where the worker found the request's adapter when the request arrived, warmest first: in a device
# slot; in host memory (copied into a slot for it); on disk (read, perhaps fetched, for it).
# "" for the base model.
ADAPTER_TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class RequestReport:
    """REPORT_KEY's object. Times in milliseconds: queue_ms arrival to first scheduled, ttft_ms
    arrival to first token, inter_token_ms the mean gap between output tokens after the first
    (None with fewer than two tokens). Over a request's choices (n > 1): the coldest tier, the
    longest queue, the earliest first token, the mean gap over every choice's tokens."""

    adapter_tier: str = ""
    queue_ms: float | None = None
    ttft_ms: float | None = None
    inter_token_ms: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, value: Any) -> RequestReport | None:
        """The report in a decoded body's REPORT_KEY value, or None when it is not an object.
        Tolerant as a reader must be: an unknown tier becomes "", a time that is not a finite
        non-negative number None."""
        if not isinstance(value, dict):
            return None
        tier = value.get("adapter_tier")

        def millis(name: str) -> float | None:
            item = value.get(name)
            if isinstance(item, bool) or not isinstance(item, int | float) or not 0 <= item < float("inf"):
                return None
            return float(item)

        return cls(
            adapter_tier=tier if tier in ADAPTER_TIERS else "",
            queue_ms=millis("queue_ms"),
            ttft_ms=millis("ttft_ms"),
            inter_token_ms=millis("inter_token_ms"),
        )


# -- completions: prefix-cache isolation ----------------------------------------------------------
# The worker reuses cached prompt KV only between requests with the same `cache_salt` (vLLM's field,
# on chat and completions; a string of 1..CACHE_SALT_MAX characters). The gateway sets it to the
# tenant's identity, so that one tenant cannot learn another's prompts by timing cache hits, and
# refuses a caller-supplied one (400, param cache_salt).
CACHE_SALT = "cache_salt"
CACHE_SALT_MAX = 256


# -- completions: the OpenAI parameters the worker refuses ----------------------------------------
# Not implemented (they need modalities, legacy function-calling or search the engine lacks). Each
# is refused with a 400 naming it (code unsupported_parameter) rather than silently ignored, unless
# its value asks for nothing (HARMLESS_VALUES). The gateway relays that 400 as it is. Structured
# output (response_format), logit_bias and forced tool calls (tools, tool_choice,
# parallel_tool_calls) are served; their bad values are 400s naming them too.
UNSUPPORTED_CHAT_FIELDS = (
    "functions",
    "function_call",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)
# OpenAI's legacy completions takes none of them (logit_bias and vLLM's response_format are served).
UNSUPPORTED_COMPLETION_FIELDS: tuple[str, ...] = ()
# Values that ask for nothing special, besides null: no legacy functions, no forced call, text only.
# Compared with their JSON type (1 is not true).
HARMLESS_VALUES: dict[str, tuple] = {
    "functions": ([],),
    "function_call": ("none",),
    "modalities": (["text"],),
}


def is_harmless(field: str, value: Any) -> bool:
    """Whether `value` for the unsupported parameter `field` asks for nothing we would ignore."""
    return value is None or any(
        type(value) is type(h) and value == h for h in HARMLESS_VALUES.get(field, ())
    )

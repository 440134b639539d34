"""Request bodies of the OpenAI-compatible routes (pydantic, strict types).

Strict mode: "0.5" is not a number and `true` is not 1, as in OpenAI's API, so a wrong type is a
400 naming the parameter rather than a silent coercion. Unknown fields are ignored (clients send
many optional OpenAI fields we have no use for, like `store` or `metadata`), except the OpenAI
parameters that would change what comes back and that the worker does not implement
(UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_COMPLETION_FIELDS, defined with the portal's side of the wire
in protocol.worker_api): asking for one is a 400 naming it, code `unsupported_parameter`, never a
plain-text 200. `response_format`, `logit_bias`, `tools`, `tool_choice` and `parallel_tool_calls`
take any JSON here: the routes check them (structured.py, tool_calls.py), naming the bad part. Engine-side limits (context length, token ids, chat roles) are checked by the
engine when the request is added.

The adapter routes' bodies (LoadLoraAdapterRequest, UnloadAdapterRequest) have exactly the fields
of protocol.worker_api's shared bodies, checked at import.

Extra fields, documented for the gateway: `tenant` (who pays for the tokens; the fair scheduler
shares the worker between tenants), `tenant_weight` (> 0, that tenant's share) and vLLM's
`cache_salt` (requests share cached prompt KV only with requests of the same salt). vLLM's
sampling extras `top_k`, `min_p`, `repetition_penalty`, `ignore_eos` and `stop_token_ids`
are accepted too, and on completions `prompt_logprobs` (with `echo` and `max_tokens: 0`, what
evaluation harnesses use to score a prompt).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from inference.engine.sampling_params import MAX_LOGPROBS
from protocol import worker_api
from protocol.worker_api import UNSUPPORTED_CHAT_FIELDS, UNSUPPORTED_COMPLETION_FIELDS, is_harmless

# A request may ask for at most this many choices (n × prompts): each is an engine request.
MAX_CHOICES = 128


def _refuse_unsupported(value: Any, info: ValidationInfo) -> Any:
    if not is_harmless(info.field_name, value):
        raise PydanticCustomError(
            worker_api.UNSUPPORTED_PARAMETER,
            "not supported yet by this server; leave it out (or send null) and the request is served as plain text",
        )
    return value


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Not strict on extra fields: tool calls, names etc. pass through to the chat template.
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: str | list[TextPart] | None = None

    def as_template_dict(self) -> dict:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # text parts are joined: the model reads plain text
            message["content"] = "".join(p.text for p in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class _Sampling(_Body):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None
    # vLLM extras
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # fair scheduling (set by the gateway)
    tenant: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    tenant_weight: Annotated[float, Field(gt=0, le=1e6)] | None = None
    # prefix caching: only requests with the same salt share cached KV (vLLM's field; the gateway
    # sets it per tenant and refuses one from its callers)
    cache_salt: Annotated[str, Field(min_length=1, max_length=worker_api.CACHE_SALT_MAX)] | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's extra: the rendered prompt's token logprobs, top-level in the response
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Checked by the route (structured.py, tool_calls.py), which names the bad part of a value.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    logit_bias: Any = None
    # UNSUPPORTED_CHAT_FIELDS: any JSON value; only harmless ones pass.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None

    _unsupported = field_validator(*UNSUPPORTED_CHAT_FIELDS)(_refuse_unsupported)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str | list[int]]
    # 0 only with echo: the prompt is scored (prefill only), nothing generated (vLLM's rule)
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    # vLLM extra: per choice, each prompt token's logprob and rank plus the k most likely tokens
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    # Checked by the route (structured.py); response_format is vLLM's extension here.
    logit_bias: Any = None
    response_format: Any = None

    if UNSUPPORTED_COMPLETION_FIELDS:  # none today
        _unsupported = field_validator(*UNSUPPORTED_COMPLETION_FIELDS)(_refuse_unsupported)


class LoadLoraAdapterRequest(_Body):
    """POST /v1/load_lora_adapter: vLLM's body plus a fetchable source. The fields, their limits
    and the rule types cannot say (exactly one of lora_path / lora_url, files with a URL) are
    protocol.worker_api.LoadAdapterBody's, the body the portal builds."""

    lora_name: Annotated[str, Field(min_length=1, max_length=worker_api.LORA_NAME_MAX)]
    lora_path: Annotated[str, Field(min_length=1)] | None = None
    lora_url: Annotated[str, Field(min_length=1, max_length=worker_api.LORA_URL_MAX)] | None = None
    files: dict[str, str] | None = None
    auth_token: str | None = None
    pin: bool = False

    def to_protocol(self) -> worker_api.LoadAdapterBody:
        """The shared body; worker_api.BodyError (naming the field) when it breaks a rule."""
        return worker_api.LoadAdapterBody(**self.model_dump())


class UnloadAdapterRequest(_Body):
    """POST /v1/unload_lora_adapter (protocol.worker_api.UnloadAdapterBody)."""

    lora_name: Annotated[str, Field(min_length=1, max_length=worker_api.LORA_NAME_MAX)]


def require_shared_fields(schema: type[BaseModel], names: tuple[str, ...]) -> None:
    """A schema of a shared body has exactly the shared body's fields: checked at import, so the
    two cannot drift apart."""
    if tuple(schema.model_fields) != names:
        raise TypeError(f"{schema.__name__} has fields {tuple(schema.model_fields)}; "
                        f"protocol.worker_api defines {names}")


require_shared_fields(LoadLoraAdapterRequest, worker_api.LOAD_ADAPTER_FIELDS)
require_shared_fields(UnloadAdapterRequest, worker_api.UNLOAD_ADAPTER_FIELDS)

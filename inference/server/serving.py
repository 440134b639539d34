"""What chat and text completions share: model resolution, backpressure, sampling parameters,
submitting to the engine, collecting or streaming outputs, and client disconnects.

A client request becomes one engine request per choice (n) and prompt; they are added all or
nothing, run in the same batches as everyone else's, and are aborted together when the client
goes away (their KV blocks and adapter references are freed on the engine thread's next turn).

Each answer (and a stream's usage chunk) carries the worker's report on the request beside
OpenAI's fields (`report`, protocol.worker_api.RequestReport under REPORT_KEY): where its adapter
was found on arrival, its queue time, time to first token and inter-token gap.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from inference.engine.outputs import RequestOutput, TokenLogprob
from inference.engine.sampling_params import SamplingParams
from inference.server import sse
from inference.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from inference.server.errors import APIError, from_value_error, model_not_found
from inference.server.protocol import _Sampling
from inference.server.structured import as_api_error
from protocol.worker_api import ADAPTER_TIERS, SERVER_OVERLOADED, WORKER_DRAINING, RequestReport

if TYPE_CHECKING:  # the engine's modules (torch) load on the engine thread, after the server bound
    from inference.engine.structured_output import StructuredOutput

RETRY_AFTER_SECONDS = 1


class ClientGone(Exception):
    """The client disconnected before the response started."""


@dataclass
class Choice:
    """One engine request's accumulated result (non-streaming) or stream state."""

    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    # echo / prompt_logprobs (completions): the prompt's ids, and its logprobs (first None)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_role: bool = False
    # For the worker's report (protocol.worker_api.RequestReport): seconds since arrival.
    adapter_tier: str = ""
    queue_time: float | None = None
    time_to_first_token: float | None = None
    latency: float | None = None


def record_output(choice: Choice, out: RequestOutput) -> None:
    """What every output tells its choice, streamed or not: token counts and timings."""
    choice.prompt_tokens = out.usage.prompt_tokens
    choice.cached_tokens = out.usage.cached_tokens
    choice.token_ids = out.token_ids
    choice.adapter_tier = out.adapter_tier
    choice.queue_time = out.queue_time
    choice.time_to_first_token = out.time_to_first_token
    choice.latency = out.latency


def sampling_params(body: _Sampling, *, max_tokens: int | None, logprobs: int | None, choice: int,
                    structured_output: StructuredOutput | None = None,
                    logit_bias: dict[int, float] | None = None) -> SamplingParams:
    """The engine's SamplingParams for choice `choice` of a request. With n > 1 and a seed,
    choice i uses seed + i: each choice is reproducible and the choices differ.
    structured_output / logit_bias: already checked (structured.py, Serving.check_grammar)."""
    values: dict = {"max_tokens": max_tokens, "logprobs": logprobs, "ignore_eos": body.ignore_eos,
                    "structured_output": structured_output, "logit_bias": logit_bias}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty"):
        value = getattr(body, name)
        if value is not None:
            values[name] = value
    if body.seed is not None:
        values["seed"] = body.seed + choice
    if body.stop is not None:
        values["stop"] = body.stop
    if body.stop_token_ids is not None:
        values["stop_token_ids"] = body.stop_token_ids
    try:
        return SamplingParams(**values)
    except ValueError as exc:
        raise from_value_error(exc) from None


class Serving:
    def __init__(self, engine: AsyncEngine, *, served_names: list[str], capacity: Callable[[], int]) -> None:
        """capacity(): how many engine requests may be in the worker at once (running slots plus
        the bounded waiting queue); beyond it requests get 503 + Retry-After."""
        self.engine = engine
        self.served_names = served_names
        self.capacity = capacity
        # Set on SIGTERM (drain.py): new requests are refused, admitted ones run to their end.
        self.draining = False

    # -- before the engine --------------------------------------------------------
    def check_ready(self) -> None:
        if self.engine.error is not None:
            raise APIError(503, f"the engine stopped: {self.engine.error}", type="service_unavailable")
        if not self.engine.ready.is_set():
            raise APIError(503, "the model is still loading; retry shortly", type="service_unavailable",
                           headers={"Retry-After": "5"})

    def resolve_model(self, model: str) -> str | None:
        """The adapter name `model` selects, or None for the base model; 404 if neither."""
        if model in self.served_names:
            return None
        if self.engine.engine.has_adapter(model):
            return model
        raise model_not_found(model)

    def admit(self, count: int) -> None:
        """Backpressure: refuse when the worker already holds its bound of requests. An idle
        worker takes any one request, so a large n is never refused forever. A draining worker
        takes nothing: its 503 comes before any byte, so the gateway tries another worker."""
        if self.draining:
            raise draining_error("the worker is shutting down; retry on another worker")
        in_flight = self.engine.in_flight
        if in_flight and in_flight + count > self.capacity():
            raise APIError(
                503, f"the server is overloaded ({in_flight} requests in flight); retry later",
                type="service_unavailable", code=SERVER_OVERLOADED,
                headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
            )

    def cut_off(self) -> int:
        """The drain's deadline: end every request still running with a worker_draining error
        (an SSE error event, or a 503 when nothing was sent yet); the engine frees their KV.
        Returns how many client requests were cut."""
        return self.engine.abort_all(draining_error("the worker shut down before this request finished"))

    async def check_grammar(self, spec: StructuredOutput, *, param: str, part: str | None = None) -> None:
        """Compile `spec` (off the event loop and the engine thread; cached) before the request
        is added: a schema the engine cannot use is a 400 for `param` (the message names the
        failing `part`), never a failed request inside a running batch."""
        # Loaded with the model, on the engine thread (torch).
        from inference.engine.structured_output import StructuredOutputError

        try:
            await self.engine.check_structured_output(spec)
        except StructuredOutputError as exc:
            raise as_api_error(exc, param=param, part=part) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="service_unavailable") from None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (logits width): token ids are below it."""
        return self.engine.engine.model_config.vocab_size

    async def submit(self, requests: list[dict], *, prompt_param: str) -> RequestStream:
        self.admit(len(requests))
        try:
            return await self.engine.add(requests)
        except ValueError as exc:
            raise from_value_error(exc, prompt_param=prompt_param) from None
        except LookupError as exc:  # the adapter was unloaded between resolve and add
            raise APIError(404, str(exc).strip("'\""), param="model", code="model_not_found") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="service_unavailable") from None

    # -- running ------------------------------------------------------------------
    async def collect(self, stream: RequestStream, choices: dict[str, Choice], request: Request) -> None:
        """Non-streaming: accumulate every output into `choices`; abort if the client leaves."""
        async def run() -> None:
            async for out in self.engine.outputs(stream):
                choice = choices[out.request_id]
                record_output(choice, out)
                choice.text = out.text
                choice.prompt_token_ids = out.prompt_token_ids
                if out.prompt_logprobs is not None:
                    choice.prompt_logprobs = out.prompt_logprobs
                if out.delta_logprobs:
                    choice.logprobs.extend(out.delta_logprobs)
                if out.finished:
                    choice.finish_reason = out.finish_reason
                    raise_if_error(out)

        await until_disconnected(run(), request, on_gone=lambda: self.engine.abort(stream))

    def stream_response(self, stream: RequestStream, first: RequestOutput,
                        events: Callable[[RequestOutput], list[str]], final: Callable[[], list[str]]) -> Response:
        """SSE: `events(out)` turns each output into SSE lines, `final()` ends the stream (usage
        chunk); an error from the engine becomes an error event."""
        async def body() -> AsyncIterator[str]:
            try:
                for line in events(first):
                    yield line
                if stream.unfinished:
                    async for out in self.engine.outputs(stream):
                        raise_if_error(out)
                        for line in events(out):
                            yield line
                for line in final():
                    yield line
            except APIError as exc:
                yield sse.error_event(exc)
            except EngineDeadError as exc:
                yield sse.error_event(APIError(503, str(exc), type="service_unavailable"))
            finally:
                self.engine.abort(stream)  # a disconnect lands here: free the KV at once
            yield sse.DONE

        return StreamingResponse(body(), media_type="text/event-stream", headers=sse.HEADERS)

    async def first_output(self, stream: RequestStream, request: Request) -> RequestOutput:
        """The first output, before the 200 goes out, so an adapter that fails to load is
        still a plain 400 (and a client that leaves while queued is noticed)."""
        async def first() -> RequestOutput:
            item = await stream.get()
            raise_if_error(item)
            return item

        try:
            return await until_disconnected(first(), request, on_gone=lambda: self.engine.abort(stream))
        except BaseException:
            self.engine.abort(stream)
            raise


def draining_error(message: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code=WORKER_DRAINING,
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def usage(choices: dict[str, Choice]) -> dict:
    """OpenAI's usage object: a prompt is billed once however many choices were sampled from it;
    prompt_tokens_details.cached_tokens: how many of its tokens the prefix cache served (the
    first choice's count)."""
    prompt = sum({c.prompt_index: c.prompt_tokens for c in choices.values()}.values())
    first: dict[int, Choice] = {}
    for c in sorted(choices.values(), key=lambda c: c.index):
        first.setdefault(c.prompt_index, c)
    cached = sum(c.cached_tokens for c in first.values())
    completion = sum(len(c.token_ids) for c in choices.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# Coldest last: a request's choices report the coldest tier any of them found (RequestReport).
_TIER_ORDER = ("", *ADAPTER_TIERS)


def report(choices: dict[str, Choice]) -> dict:
    """The worker's report on a client request (protocol.worker_api.RequestReport, REPORT_KEY),
    from its choices' last outputs: the coldest adapter tier, the longest queue time, the earliest
    first token, and the mean gap between tokens after each choice's first, in milliseconds."""
    values = list(choices.values())
    tier = max((c.adapter_tier for c in values), key=_TIER_ORDER.index, default="")
    queued = [c.queue_time for c in values if c.queue_time is not None]
    firsts = [c.time_to_first_token for c in values if c.time_to_first_token is not None]
    # Decoding after the first token: (latency - ttft) over (tokens - 1), summed over finished choices.
    decoded = [(c.latency - c.time_to_first_token, len(c.token_ids) - 1) for c in values
               if c.latency is not None and c.time_to_first_token is not None and len(c.token_ids) >= 2]
    gaps = sum(n for _, n in decoded)
    return RequestReport(
        adapter_tier=tier,
        queue_ms=max(queued) * 1000 if queued else None,
        ttft_ms=min(firsts) * 1000 if firsts else None,
        inter_token_ms=max(0.0, sum(t for t, _ in decoded)) * 1000 / gaps if gaps else None,
    ).to_json()


# Engine errors that come from the request's output constraint, not from its model: a grammar
# that failed to compile after the pre-check passed (it was evicted from the cache and compiled
# again), or a parser limit reached mid-output (structured_output.py names the part first).
_STRUCTURED_ERROR_PREFIXES = ("response_format", "grammar:", "structured output:")


def raise_if_error(out: RequestOutput) -> None:
    if out.finished and out.finish_reason == "error":
        message = getattr(out, "error", None) or "the request failed"
        if message.startswith(_STRUCTURED_ERROR_PREFIXES):
            raise APIError(400, message, param="response_format" if message.startswith("response_format") else None,
                           code="structured_output_failed")
        raise APIError(400, message, param="model", code="adapter_load_failed")


async def until_disconnected(coro, request: Request, *, on_gone: Callable[[], None]):
    """Run `coro`, cancelling it (and calling on_gone) if the client disconnects first."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_gone()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    on_gone()
    raise ClientGone()


async def _wait_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def engine_kwargs(body: _Sampling, adapter_name: str | None) -> dict:
    kwargs: dict = {"tenant": body.tenant, "cache_salt": body.cache_salt}
    if body.tenant_weight is not None:
        kwargs["weight"] = body.tenant_weight
    if adapter_name is not None:
        kwargs["lora"] = adapter_name
    return kwargs

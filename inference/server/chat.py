"""POST /v1/chat/completions: chat messages through the checkpoint's template, OpenAI's
chat.completion / chat.completion.chunk objects out."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inference.engine.outputs import RequestOutput, TokenLogprob
from inference.server import sse
from inference.server.errors import APIError
from inference.server.protocol import ChatCompletionRequest
from inference.server.serving import (
    Choice,
    ClientGone,
    Serving,
    engine_kwargs,
    new_id,
    now,
    sampling_params,
    usage,
)


def token_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> list[dict]:
    """OpenAI's chat logprobs.content entries."""
    def entry(token_id: int, logprob: float) -> dict:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
        for lp in logprobs
    ]


async def create_chat_completion(serving: Serving, body: ChatCompletionRequest, request: Request) -> Response:
    serving.check_ready()
    adapter_name = serving.resolve_model(body.model)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    messages = [m.as_template_dict() for m in body.messages]
    extra = engine_kwargs(body, adapter_name)
    requests = [
        {"messages": messages, "params": sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, choice=i),
         **extra}
        for i in range(body.n)
    ]
    stream = await serving.submit(requests, prompt_param="messages")
    choices = {rid: Choice(index=i, prompt_index=0) for i, rid in enumerate(stream.request_ids)}
    response_id, created = new_id("chatcmpl"), now()
    tokenizer = serving.engine.engine.tokenizer

    try:
        if not body.stream:
            await serving.collect(stream, choices, request)
            return JSONResponse(_completion(body, response_id, created, choices, tokenizer))
        first = await serving.first_output(stream, request)
    except ClientGone:
        return Response(status_code=499)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_field = {"usage": None} if include_usage else {}

    def chunk(choice_list: list[dict]) -> str:
        return sse.event({"id": response_id, "object": "chat.completion.chunk", "created": created,
                          "model": body.model, "choices": choice_list, **usage_field})

    def events(out: RequestOutput) -> list[str]:
        choice = choices[out.request_id]
        choice.prompt_tokens = out.usage.prompt_tokens
        choice.cached_tokens = out.usage.cached_tokens
        choice.token_ids = out.token_ids
        lines = []
        if not choice.sent_role:  # OpenAI's first chunk of a choice carries only the role
            choice.sent_role = True
            lines.append(chunk([{"index": choice.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]))
        if out.delta_text or out.delta_logprobs:
            logprobs_obj = ({"content": token_logprobs(tokenizer, out.delta_logprobs)}
                            if body.logprobs and out.delta_logprobs else None)
            lines.append(chunk([{"index": choice.index, "delta": {"content": out.delta_text},
                                 "logprobs": logprobs_obj, "finish_reason": None}]))
        if out.finished:
            lines.append(chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                 "finish_reason": out.finish_reason}]))
        return lines

    def final() -> list[str]:
        if not include_usage:
            return []
        return [sse.event({"id": response_id, "object": "chat.completion.chunk", "created": created,
                           "model": body.model, "choices": [], "usage": usage(choices)})]

    return serving.stream_response(stream, first, events, final)



def _completion(body: ChatCompletionRequest, response_id: str, created: int, choices: dict[str, Choice],
                tokenizer) -> dict:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": {"content": token_logprobs(tokenizer, c.logprobs)} if body.logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for c in sorted(choices.values(), key=lambda c: c.index)
        ],
        "usage": usage(choices),
    }

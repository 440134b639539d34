"""POST /v1/completions: raw text (or token-id) prompts, OpenAI's text_completion objects out.

`prompt` may be a string, a list of strings, a list of token ids or a list of those; every
prompt gets `n` choices, numbered prompt by prompt (choice index = prompt_index * n + i).
"""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inference.engine.outputs import RequestOutput, TokenLogprob
from inference.server import sse
from inference.server.errors import APIError
from inference.server.protocol import MAX_CHOICES, CompletionRequest
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

# OpenAI's default for /v1/completions (chat has none: it runs to the context length).
DEFAULT_MAX_TOKENS = 16


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def text_logprobs(tokenizer, logprobs: list[TokenLogprob], offset: int, top: bool) -> dict:
    """OpenAI's completions logprobs object; text_offset counts from `offset`."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        token = tokenizer.decode([lp.token_id], skip_special_tokens=False)
        tokens.append(token)
        values.append(lp.logprob)
        offsets.append(offset)
        offset += len(token)
        if top:
            tops.append({tokenizer.decode([t], skip_special_tokens=False): p for t, p in lp.top})
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if top else None,
            "text_offset": offsets}


async def create_completion(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    serving.check_ready()
    adapter_name = serving.resolve_model(body.model)
    if body.echo:
        raise APIError(400, "echo: not supported", param="echo")
    if body.suffix is not None:
        raise APIError(400, "suffix: not supported by this model", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of: only best_of = n is supported", param="best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options: only allowed when stream is true", param="stream_options")
    prompts = _prompts(body.prompt)
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"n: {len(prompts)} prompts x n={body.n} exceeds {MAX_CHOICES} choices", param="n")
    max_tokens = body.max_tokens if body.max_tokens is not None else DEFAULT_MAX_TOKENS
    extra = engine_kwargs(body, adapter_name)
    requests, prompt_index = [], []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, choice=i)
            requests.append({"prompt": prompt, "params": params, **extra})
            prompt_index.append(p)
    stream = await serving.submit(requests, prompt_param="prompt")
    choices = {rid: Choice(index=i, prompt_index=prompt_index[i]) for i, rid in enumerate(stream.request_ids)}
    response_id, created = new_id("cmpl"), now()
    tokenizer = serving.engine.engine.tokenizer
    want_top = bool(body.logprobs)

    try:
        if not body.stream:
            await serving.collect(stream, choices, request)
            return JSONResponse(_completion(body, response_id, created, choices, tokenizer, want_top))
        first = await serving.first_output(stream, request)
    except ClientGone:
        return Response(status_code=499)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_field = {"usage": None} if include_usage else {}
    text_offsets = {rid: 0 for rid in choices}

    def events(out: RequestOutput) -> list[str]:
        choice = choices[out.request_id]
        choice.prompt_tokens = out.usage.prompt_tokens
        choice.cached_tokens = out.usage.cached_tokens
        choice.token_ids = out.token_ids
        if not (out.delta_text or out.delta_logprobs or out.finished):
            return []
        logprobs = None
        if body.logprobs is not None and out.delta_logprobs:
            logprobs = text_logprobs(tokenizer, out.delta_logprobs, text_offsets[out.request_id], want_top)
        text_offsets[out.request_id] += len(out.delta_text)
        return [sse.event({
            "id": response_id, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"index": choice.index, "text": out.delta_text, "logprobs": logprobs,
                         "finish_reason": out.finish_reason if out.finished else None}],
            **usage_field,
        })]

    def final() -> list[str]:
        if not include_usage:
            return []
        return [sse.event({"id": response_id, "object": "text_completion", "created": created,
                           "model": body.model, "choices": [], "usage": usage(choices)})]

    return serving.stream_response(stream, first, events, final)



def _completion(body: CompletionRequest, response_id: str, created: int, choices: dict[str, Choice], tokenizer,
                want_top: bool) -> dict:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": text_logprobs(tokenizer, c.logprobs, 0, want_top) if body.logprobs is not None else None,
                "finish_reason": c.finish_reason,
            }
            for c in sorted(choices.values(), key=lambda c: c.index)
        ],
        "usage": usage(choices),
    }

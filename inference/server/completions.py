"""POST /v1/completions: raw text (or token-id) prompts, OpenAI's text_completion objects out.

`prompt` may be a string, a list of strings, a list of token ids or a list of those; every
prompt gets `n` choices, numbered prompt by prompt (choice index = prompt_index * n + i).

Scoring a prompt (what lm-evaluation-harness's `local-completions` does), as vLLM:
  - `echo: true`: each choice's text starts with the prompt (a token-id prompt decoded), and with
    `logprobs: k` its logprobs cover the prompt tokens first (the first prompt token has none:
    `token_logprobs[0]` and `top_logprobs[0]` are null), then the generated ones. Streaming
    echoes in each choice's first chunk.
  - `max_tokens: 0` (only with echo): prefill only; finish_reason "length", 0 completion tokens.
  - `prompt_logprobs: k` (vLLM's extra, not with streaming): per choice a list with one entry
    per prompt token, the first null, each {token_id: {logprob, rank, decoded_token}} for the
    prompt token and the k most likely tokens at that position.
A request that needs prompt logprobs computes its whole prompt (no prefix-cache hit: a cached
prefix has no logits).
"""

from __future__ import annotations

import dataclasses

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
    record_output,
    report,
    sampling_params,
    usage,
)
from inference.server.structured import logit_bias, response_format
from protocol.worker_api import REPORT_KEY

# OpenAI's default for /v1/completions (chat has none: it runs to the context length).
DEFAULT_MAX_TOKENS = 16
# What OpenAI (and vLLM) send for a logprob of -inf, which JSON cannot carry.
MIN_LOGPROB = -9999.0


def _prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def text_logprobs(tokenizer, logprobs: list[TokenLogprob | None], offset: int, top: int | None,
                  token_ids: list[int] | None = None) -> dict:
    """OpenAI's completions logprobs object; text_offset counts from `offset`. top: how many
    alternatives per position (0 or None: none); as vLLM, each position's top_logprobs holds the
    token itself and its `top` most likely alternatives. A None entry (the first prompt token
    with echo; its id from `token_ids`) has a null logprob and a null top_logprobs."""
    tokens, values, tops, offsets = [], [], [], []
    for i, lp in enumerate(logprobs):
        token_id = lp.token_id if lp is not None else token_ids[i]
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(max(lp.logprob, MIN_LOGPROB))
        if top:
            alternatives = {token: max(lp.logprob, MIN_LOGPROB)}
            for t, p in lp.top[:top]:
                alternatives.setdefault(tokenizer.decode([t], skip_special_tokens=False), max(p, MIN_LOGPROB))
            tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops if top else None,
            "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer, prompt_logprobs: list[TokenLogprob | None], k: int) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token_id: {logprob,
    rank, decoded_token}} for the prompt token and the k most likely tokens (ranks 1..k)."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank,
                "decoded_token": tokenizer.decode([token_id], skip_special_tokens=False)}

    out: list[dict | None] = []
    for lp in prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        position = {str(lp.token_id): entry(lp.token_id, lp.logprob, lp.rank)}
        for rank, (t, p) in enumerate(lp.top[:k], start=1):
            position.setdefault(str(t), entry(t, p, rank))
        out.append(position)
    return out


def _prompt_logprobs_wanted(body: CompletionRequest) -> int | None:
    """How many alternatives the engine scores per prompt token: enough for prompt_logprobs and
    for echo's logprobs; None when neither asks."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _echo_text(tokenizer, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt, skip_special_tokens=False)


async def create_completion(serving: Serving, body: CompletionRequest, request: Request) -> Response:
    serving.check_ready()
    adapter_name = serving.resolve_model(body.model)
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens: 0 is only allowed with echo (the prompt is scored, nothing generated)",
                       param="max_tokens")
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs: not available when stream is true", param="prompt_logprobs")
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
    structured_output = response_format(body.response_format)  # vLLM's extension on completions
    if structured_output is not None:
        await serving.check_grammar(structured_output, param="response_format")
    bias = logit_bias(body.logit_bias, serving.vocab_size)
    extra = engine_kwargs(body, adapter_name)
    score_prompt = _prompt_logprobs_wanted(body)
    requests, prompt_index = [], []
    for p, prompt in enumerate(prompts):
        for i in range(body.n):
            params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, choice=i,
                                     structured_output=structured_output, logit_bias=bias)
            if score_prompt is not None:
                params = dataclasses.replace(params, prompt_logprobs=score_prompt)
            requests.append({"prompt": prompt, "params": params, **extra})
            prompt_index.append(p)
    stream = await serving.submit(requests, prompt_param="prompt")
    choices = {rid: Choice(index=i, prompt_index=prompt_index[i]) for i, rid in enumerate(stream.request_ids)}
    response_id, created = new_id("cmpl"), now()
    tokenizer = serving.engine.engine.tokenizer
    want_top = body.logprobs
    echo_texts = [_echo_text(tokenizer, p) for p in prompts] if body.echo else []

    try:
        if not body.stream:
            await serving.collect(stream, choices, request)
            return JSONResponse(_completion(body, response_id, created, choices, tokenizer, want_top, echo_texts))
        first = await serving.first_output(stream, request)
    except ClientGone:
        return Response(status_code=499)

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    usage_field = {"usage": None} if include_usage else {}
    text_offsets = {rid: 0 for rid in choices}
    echoed: set[str] = set()

    def events(out: RequestOutput) -> list[str]:
        choice = choices[out.request_id]
        record_output(choice, out)
        text, delta_logprobs, delta_ids = out.delta_text, list(out.delta_logprobs or ()), list(out.delta_token_ids)
        if body.echo and out.request_id not in echoed:  # the prompt rides in the first chunk
            echoed.add(out.request_id)
            text = echo_texts[choice.prompt_index] + text
            delta_logprobs = list(out.prompt_logprobs or ()) + delta_logprobs
            delta_ids = list(out.prompt_token_ids) + delta_ids
        if not (text or delta_logprobs or out.finished):
            return []
        logprobs = None
        if body.logprobs is not None and delta_logprobs:
            logprobs = text_logprobs(tokenizer, delta_logprobs, text_offsets[out.request_id], want_top, delta_ids)
        text_offsets[out.request_id] += len(text)
        return [sse.event({
            "id": response_id, "object": "text_completion", "created": created, "model": body.model,
            "choices": [{"index": choice.index, "text": text, "logprobs": logprobs,
                         "finish_reason": out.finish_reason if out.finished else None}],
            **usage_field,
        })]

    def final() -> list[str]:
        if not include_usage:
            return []
        return [sse.event({"id": response_id, "object": "text_completion", "created": created,
                           "model": body.model, "choices": [], "usage": usage(choices),
                           REPORT_KEY: report(choices)})]

    return serving.stream_response(stream, first, events, final)



def _completion(body: CompletionRequest, response_id: str, created: int, choices: dict[str, Choice], tokenizer,
                want_top: int | None, echo_texts: list[str]) -> dict:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": body.model,
        "choices": [_choice(body, c, tokenizer, want_top, echo_texts) for c in sorted(choices.values(),
                                                                                     key=lambda c: c.index)],
        "usage": usage(choices),
        REPORT_KEY: report(choices),  # the worker's extension (timings, adapter tier): clients ignore it
    }


def _choice(body: CompletionRequest, c: Choice, tokenizer, want_top: int | None, echo_texts: list[str]) -> dict:
    text, logprobs, token_ids = c.text, list(c.logprobs), list(c.token_ids)
    if body.echo:
        text = echo_texts[c.prompt_index] + text
        logprobs = list(c.prompt_logprobs or ()) + logprobs
        token_ids = list(c.prompt_token_ids) + token_ids
    choice = {
        "index": c.index,
        "text": text,
        "logprobs": text_logprobs(tokenizer, logprobs, 0, want_top, token_ids) if body.logprobs is not None else None,
        "finish_reason": c.finish_reason,
    }
    if body.prompt_logprobs is not None:
        choice["prompt_logprobs"] = (vllm_prompt_logprobs(tokenizer, c.prompt_logprobs, body.prompt_logprobs)
                                     if c.prompt_logprobs is not None else None)
    return choice

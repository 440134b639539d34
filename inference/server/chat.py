"""POST /v1/chat/completions: chat messages through the checkpoint's template, OpenAI's
chat.completion / chat.completion.chunk objects out. `response_format` and `logit_bias`
(structured.py) and forced tool calls (tool_calls.py, tool_prompt.py) are checked here, their
grammar compiled before the request is added."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inference.engine.outputs import RequestOutput, TokenLogprob
from inference.server import sse
from inference.server.completions import vllm_prompt_logprobs
from inference.server.errors import APIError, from_value_error
from inference.server.protocol import ChatCompletionRequest
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
from inference.server.structured import lark_output, logit_bias, response_format
from inference.server.tool_calls import ToolCallReader, ToolPlan, arguments_json, tool_plan
from inference.server.tool_prompt import (
    template_takes_tools,
    with_calls_in_text,
    with_tools_in_text,
)
from protocol.worker_api import REPORT_KEY

if TYPE_CHECKING:
    from inference.engine.structured_output import StructuredOutput


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
    if body.prompt_logprobs is not None and body.stream:
        raise APIError(400, "prompt_logprobs: not available when stream is true", param="prompt_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    plan = tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
    structured_output = response_format(body.response_format)
    if plan is not None and structured_output is not None:
        raise APIError(400, "response_format: cannot be combined with a forced tool call (tool_choice); the "
                            "call's arguments follow the function's parameters", param="response_format")
    bias = logit_bias(body.logit_bias, serving.vocab_size)
    tokenizer = serving.engine.engine.tokenizer
    prompt = _prompt([m.as_template_dict() for m in body.messages], plan, tokenizer)
    if plan is not None:
        structured_output = await _tool_grammar(serving, plan)
    elif structured_output is not None:
        await serving.check_grammar(structured_output, param="response_format")
    extra = engine_kwargs(body, adapter_name)
    params = [sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, choice=i,
                              structured_output=structured_output, logit_bias=bias) for i in range(body.n)]
    if body.prompt_logprobs is not None:  # only the first choice scores the prompt: all share it
        params[0] = dataclasses.replace(params[0], prompt_logprobs=body.prompt_logprobs)
    requests = [{**prompt, "params": p, **extra} for p in params]
    stream = await serving.submit(requests, prompt_param="messages")
    choices = {rid: Choice(index=i, prompt_index=0) for i, rid in enumerate(stream.request_ids)}
    # Forced tool calls: each choice's output is read back as tool calls (tool_calls.py).
    readers = {rid: ToolCallReader(plan) for rid in choices} if plan is not None else {}
    response_id, created = new_id("chatcmpl"), now()

    try:
        if not body.stream:
            await serving.collect(stream, choices, request)
            return JSONResponse(_completion(body, response_id, created, choices, tokenizer, readers))
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
        record_output(choice, out)
        reader = readers.get(out.request_id)
        lines = []
        if not choice.sent_role:  # OpenAI's first chunk of a choice carries only the role
            choice.sent_role = True
            lines.append(chunk([{"index": choice.index, "delta": {"role": "assistant",
                                                                  "content": None if reader else ""},
                                 "logprobs": None, "finish_reason": None}]))
        logprobs_obj = ({"content": token_logprobs(tokenizer, out.delta_logprobs)}
                        if body.logprobs and out.delta_logprobs else None)
        if reader is not None:
            # One chunk per tool-call delta: the first of a call carries its id, type and name.
            deltas = [{"tool_calls": [d]} for d in reader.feed(out.delta_text)]
            if logprobs_obj is not None and not deltas:
                deltas = [{}]
            for j, delta in enumerate(deltas):
                lines.append(chunk([{"index": choice.index, "delta": delta,
                                     "logprobs": logprobs_obj if j == 0 else None, "finish_reason": None}]))
        elif out.delta_text or out.delta_logprobs:
            lines.append(chunk([{"index": choice.index, "delta": {"content": out.delta_text},
                                 "logprobs": logprobs_obj, "finish_reason": None}]))
        if out.finished:
            lines.append(chunk([{"index": choice.index, "delta": {}, "logprobs": None,
                                 "finish_reason": _finish_reason(out.finish_reason, reader)}]))
        return lines

    def final() -> list[str]:
        if not include_usage:
            return []
        return [sse.event({"id": response_id, "object": "chat.completion.chunk", "created": created,
                           "model": body.model, "choices": [], "usage": usage(choices),
                           REPORT_KEY: report(choices)})]

    return serving.stream_response(stream, first, events, final)



def _completion(body: ChatCompletionRequest, response_id: str, created: int, choices: dict[str, Choice],
                tokenizer, readers: dict[str, ToolCallReader]) -> dict:
    out = []
    for request_id, c in sorted(choices.items(), key=lambda item: item[1].index):
        message: dict = {"role": "assistant", "content": c.text}
        reader = readers.get(request_id)
        if reader is not None:
            reader.feed(c.text)
            message = {"role": "assistant", "content": None}
            if calls := reader.tool_calls():
                message["tool_calls"] = calls
        out.append({
            "index": c.index,
            "message": message,
            "logprobs": {"content": token_logprobs(tokenizer, c.logprobs)} if body.logprobs else None,
            "finish_reason": _finish_reason(c.finish_reason, reader),
        })
    response = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": body.model,
        "choices": out,
        "usage": usage(choices),
        REPORT_KEY: report(choices),  # the worker's extension (timings, adapter tier): clients ignore it
    }
    if body.prompt_logprobs is not None:
        # vLLM's place for it: the response's top level (every choice shares the one prompt)
        scored = next((c.prompt_logprobs for c in choices.values() if c.prompt_logprobs is not None), None)
        response["prompt_logprobs"] = (vllm_prompt_logprobs(tokenizer, scored, body.prompt_logprobs)
                                       if scored is not None else None)
    return response


def _finish_reason(reason: str | None, reader: ToolCallReader | None) -> str | None:
    """OpenAI's "tool_calls" when a forced call ended as the grammar allows; a call cut short
    keeps the engine's reason ("length", or "stop" for a stop string)."""
    if reader is not None and reason == "stop" and reader.complete:
        return "tool_calls"
    return reason


def _prompt(messages: list[dict], plan: ToolPlan | None, tokenizer) -> dict:
    """The engine request's prompt: {"messages": ...}, or {"prompt": ids} when the chat
    template renders the tools itself (tool_prompt.py says how tools reach the model)."""
    template = tokenizer.chat_template
    if not template.mentions("tool_calls"):
        messages = with_calls_in_text(messages)
    if plan is None:
        return {"messages": messages}
    if not template_takes_tools(template):
        return {"messages": with_tools_in_text(messages, plan.functions)}
    try:
        # Encoded here, as the engine encodes chats (special tokens only from the template),
        # because the engine's add_request takes no tools.
        return {"prompt": tokenizer.encode_chat(messages, tools=[f.as_tool() for f in plan.functions])}
    except ValueError as exc:
        raise from_value_error(exc, prompt_param="messages") from None


async def _tool_grammar(serving: Serving, plan: ToolPlan) -> StructuredOutput:
    """The grammar of a forced call, compiled before the request is added. Each function's
    arguments grammar is compiled on its own first, so a bad one is named
    (tools[i].function.parameters); for a named function that is the whole grammar."""
    for function in plan.functions:
        part = f"{function.where}.parameters"
        await serving.check_grammar(lark_output(f"start: {arguments_json(function)}\n", param=part, part=part),
                                    param=part, part=part)
    spec = lark_output(plan.grammar(), param="tools", part="tools")
    await serving.check_grammar(spec, param="tools", part="tools")
    return spec

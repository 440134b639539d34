"""Tools and earlier tool calls in the chat prompt, for templates that know about tools and for
those that don't.

A template that mentions `tools` (Llama 3.1, Qwen 2.5, Hermes...) renders the tool definitions
itself, the way the model was trained: it gets them as HF's `tools` ([{"type": "function",
"function": {...}}], OpenAI's own shape) and the messages as they came (assistant `tool_calls`,
role "tool" with `tool_call_id`).

A template that does not (SmolLM2's plain ChatML) would silently drop them, so the model would
call functions it was never shown. For those the definitions go into the system message as text
(appended to the caller's system message, or as a new first one), and an assistant turn's
`tool_calls` become its text, written the way this server makes the model write a call (JSON
{"name", "arguments"} objects): the model sees its earlier calls in the form it is asked to
produce. Tool results (role "tool") are rendered by the template like any other turn.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from inference.models.chat_template import ChatTemplate
from inference.server.tool_calls import Function

PREAMBLE = ("You can call these functions. Each is given as its name, what it does and a JSON schema "
            "of its arguments:\n{functions}\nA call is written as JSON: "
            '{{"name": <function name>, "arguments": <arguments object>}}.')


def template_takes_tools(template: ChatTemplate) -> bool:
    return template.mentions("tools")


def with_tools_in_text(messages: list[dict], functions: Sequence[Function]) -> list[dict]:
    """`messages` with the function definitions in the system message (see the module docstring)."""
    described = json.dumps(
        [{"name": f.name, **({"description": f.description} if f.description else {}), "parameters": f.parameters}
         for f in functions],
        ensure_ascii=False)
    preamble = PREAMBLE.format(functions=described)
    messages = list(messages)
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        first = messages[0]
        messages[0] = {**first, "content": f"{first['content']}\n\n{preamble}" if first["content"] else preamble}
    else:
        messages.insert(0, {"role": "system", "content": preamble})
    return messages


def with_calls_in_text(messages: list[dict]) -> list[dict]:
    """Assistant messages' `tool_calls` written into their content (templates without tools)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list) and calls:
            written = [_call_text(call) for call in calls]
            text = json.dumps(written[0] if len(written) == 1 else written, ensure_ascii=False)
            content = message.get("content") or ""
            message = {**message, "content": f"{content}\n{text}" if content else text}
        out.append(message)
    return out


def _call_text(call: Any) -> Any:
    """{"name", "arguments"} of an OpenAI tool call; arguments parsed when they are JSON."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # shown as the string the caller sent
    return {"name": function.get("name"), "arguments": arguments}

"""OpenAI function calling on top of structured output: `tools` + `tool_choice` in, `tool_calls` out.

The model is made to call a function by constraining its output with a grammar (the engine's
StructuredOutput); the text it writes is then read back as OpenAI tool calls:

    tool_choice                          the output must be (compact JSON)   tool_calls
    {"type": "function",                 that function's arguments:          one call of it
     "function": {"name": "f"}}          {"city":"Paris"}
    "required" (parallel_tool_calls      one call object, any of the tools:  one call
     false or absent)                    {"name":"f","arguments":{...}}
    "required", parallel_tool_calls      a non-empty array of call objects:  one per element
     true                                [{"name":"f","arguments":{...}}, ...]
    "none"                               plain text; the tools are ignored   none

The grammar is Lark (llguidance's dialect, StructuredOutput.lark) rather than one JSON schema
with `anyOf` over {"name": {"const": ...}, "arguments": ...} objects, because it can say what a
schema cannot: `name` comes first (a stream knows the call before its arguments arrive) and each
function's arguments keep the property order of its schema (%json, as OpenAI writes them). A call
object is `{"name":` + one function's name + `,"arguments":` + its parameters' %json + `}`.
`arguments` is the model's JSON text of the arguments object, exactly as written (the
concatenated stream fragments equal it).

OpenAI's parallel_tool_calls defaults to true, which allows several calls without asking for
them; absent, we make the model write one call, because a model made to write an array of calls
in a grammar rather than its own format tends to repeat calls until max_tokens (SmolLM2 does).
An explicit true opts into the array.

"auto" (the default when tools are given) is refused: deciding whether to call needs the
model's own tool-call syntax, which the served chat templates do not define.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.server.errors import APIError

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# OpenAI's error code for a value the endpoint does not take.
UNSUPPORTED_VALUE = "unsupported_value"
# A function with no `parameters` takes none: its arguments are an empty object.
NO_PARAMETERS: dict = {"type": "object", "properties": {}, "additionalProperties": False}
_ID_ALPHABET = string.ascii_letters + string.digits
# Compact JSON arguments, as the engine writes JSON (structured_output.py): llguidance's
# per-schema options (its %json in Lark defaults to flexible whitespace).
_JSON_OPTIONS = {"whitespace_flexible": False}

Mode = Literal["named", "required"]


@dataclass(frozen=True)
class Function:
    index: int  # its place in the request's tools (error messages name tools[index])
    name: str
    description: str | None
    parameters: dict  # a JSON schema of type object

    @property
    def where(self) -> str:
        return f"tools[{self.index}].function"

    def as_tool(self) -> dict:
        """OpenAI's (and HF chat templates') {"type": "function", "function": {...}}."""
        function = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask for: `mode` "named" (call `functions[0]`, the one named by
    tool_choice) or "required" (call any of `functions`; an array of calls when `parallel`)."""

    mode: Mode
    functions: tuple[Function, ...]
    parallel: bool

    def grammar(self) -> str:
        """The Lark grammar (llguidance's dialect) the output must match (see the module docstring)."""
        if self.mode == "named":
            return f"start: {arguments_json(self.functions[0])}\n"
        rules = [f"call_{i}: {_literal(_call_prefix(f))} {arguments_json(f)} {_literal('}')}"
                 for i, f in enumerate(self.functions)]
        call = "call: " + " | ".join(f"call_{i}" for i in range(len(self.functions)))
        start = (f"start: {_literal('[')} call ({_literal(',')} call)* {_literal(']')}" if self.parallel
                 else "start: call")
        return "\n".join([start, call, *rules]) + "\n"


def arguments_json(function: Function) -> str:
    """A function's arguments in Lark: its parameters schema as llguidance's %json, compact, its
    objects closed to undeclared properties (structured_output.closed_objects)."""
    from inference.engine.structured_output import closed_objects

    return "%json " + json.dumps({**closed_objects(function.parameters), "x-guidance": _JSON_OPTIONS})


def _call_prefix(function: Function) -> str:
    return '{"name":' + json.dumps(function.name) + ',"arguments":'


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: double quotes, backslash escapes


def tool_plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolPlan | None:
    """The plan for a chat request's tool fields, or None for a plain-text answer. Raises a 400
    APIError naming the parameter for a malformed tool, an unknown tool_choice, or "auto"."""
    functions = _functions(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls: expected true or false", param="parallel_tool_calls")
    if tool_choice == "none":
        return None
    if tool_choice is None or tool_choice == "auto":
        if not functions:
            return None  # nothing to call: "auto" means plain text
        raise APIError(
            400, 'tool_choice: "auto" (the default when tools are given) is not supported by this server: '
                 'send "required", {"type": "function", "function": {"name": ...}} or "none"',
            param="tool_choice", code=UNSUPPORTED_VALUE)
    if tool_choice == "required":
        if not functions:
            raise APIError(400, 'tool_choice: "required" needs at least one function in tools', param="tool_choice")
        return ToolPlan("required", tuple(functions), parallel_tool_calls is True)
    name = _named_choice(tool_choice)
    chosen = [f for f in functions if f.name == name]
    if not chosen:
        raise APIError(400, f"tool_choice.function.name: {name!r} is not a function in tools", param="tool_choice")
    return ToolPlan("named", (chosen[0],), False)


def _named_choice(tool_choice: Any) -> str:
    """The function name of {"type": "function", "function": {"name": ...}}."""
    if isinstance(tool_choice, str):
        raise APIError(400, f'tool_choice: unknown value {tool_choice!r}: expected "none", "auto", "required" '
                            'or {"type": "function", "function": {"name": ...}}', param="tool_choice")
    if not isinstance(tool_choice, Mapping) or tool_choice.get("type") != "function":
        raise APIError(400, 'tool_choice: expected "none", "auto", "required" or '
                            '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, Mapping) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice.function.name: expected a function name", param="tool_choice")
    return name


def _functions(tools: Any) -> list[Function]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise APIError(400, "tools: expected a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    functions: list[Function] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise APIError(400, f"{where}: expected an object", param=where)
        if tool.get("type") != "function":
            raise APIError(400, f"{where}.type: expected \"function\", got {tool.get('type')!r}", param=f"{where}.type")
        functions.append(_function(tool.get("function"), i))
        if any(f.name == functions[-1].name for f in functions[:-1]):
            raise APIError(400, f"{where}.function.name: {functions[-1].name!r} is defined twice",
                           param=f"{where}.function.name")
    return functions


def _function(function: Any, index: int) -> Function:
    where = f"tools[{index}].function"
    if not isinstance(function, Mapping):
        raise APIError(400, f"{where}: expected an object with a name", param=where)
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        got = "missing" if name is None else f"got {name!r}"
        raise APIError(400, f"{where}.name: expected 1 to 64 of a-z, A-Z, 0-9, _ and -; {got}", param=f"{where}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description: expected a string", param=f"{where}.description")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError(400, f"{where}.strict: expected true or false", param=f"{where}.strict")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    elif not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        raise APIError(400, f'{where}.parameters: expected a JSON schema of {{"type": "object", ...}}',
                       param=f"{where}.parameters")
    return Function(index, name, description, dict(parameters))


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


# -- reading the output back ---------------------------------------------------------------------
@dataclass
class _Call:
    id: str
    name: str | None = None
    args_start: int | None = None  # offset of the arguments value in the text
    args_end: int | None = None  # one past its end, once it is complete
    sent_header: bool = False  # streaming: the delta with id, type and name went out
    sent_args: int = 0  # streaming: offset up to which arguments were sent


@dataclass
class ToolCallReader:
    """Reads the constrained output (see ToolPlan.schema) as it arrives, text delta by text
    delta, into tool calls: `feed` returns the new OpenAI tool-call deltas (the first of a
    call carries index, id, type, name and arguments ""; later ones argument fragments),
    `tool_calls()` the calls so far. A small JSON scanner: it tracks strings and nesting to
    find each call's name and the span of its arguments; the grammar guarantees the shape."""

    plan: ToolPlan
    text: str = ""
    calls: list[_Call] = field(default_factory=list)
    # scanner state
    _pos: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _string_start: int = 0
    _key: str | None = None  # the key whose value comes next in the current call object
    _expect_key: bool = False
    _value_next: bool = False  # after a ':' of a call object (or, named, at the start)
    _value_depth: int | None = None  # depth of the arguments container while inside it
    _name_start: int | None = None

    def __post_init__(self) -> None:
        if self.plan.mode == "named":  # the whole output is the arguments value
            self.calls.append(_Call(new_call_id(), name=self.plan.functions[0].name))
            self._key, self._value_next = "arguments", True
        # Call objects sit at depth 1 (one object) or 2 (inside the array).
        self._call_depth = 2 if self.plan.mode == "required" and self.plan.parallel else 1

    @property
    def complete(self) -> bool:
        """Whether the output is a whole JSON value (not cut short by max_tokens or a stop)."""
        started = self.text.strip() != ""
        return started and self._depth == 0 and not self._in_string and all(
            c.name is not None and c.args_end is not None for c in self.calls) and bool(self.calls)

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        self._scan()
        return self._deltas()

    def tool_calls(self) -> list[dict]:
        """OpenAI's message.tool_calls: every call whose name is known (arguments as written,
        cut short if the output was)."""
        return [{"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": self._arguments(c)}}
                for c in self.calls if c.name is not None]

    def _arguments(self, call: _Call) -> str:
        if call.args_start is None:
            return ""
        return self.text[call.args_start:call.args_end if call.args_end is not None else len(self.text)]

    def _deltas(self) -> list[dict]:
        out = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue  # the name comes first in the stream: hold the arguments until it is known
            args = self._arguments(call)
            if not call.sent_header:
                call.sent_header = True
                out.append({"index": index, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}})
            if len(args) > call.sent_args:
                out.append({"index": index, "function": {"arguments": args[call.sent_args:]}})
                call.sent_args = len(args)
        return out

    def _scan(self) -> None:
        text = self.text
        while self._pos < len(text):
            i, ch = self._pos, text[self._pos]
            self._pos += 1
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
                    self._end_string(i + 1)
                continue
            if ch.isspace():
                continue
            in_arguments = self._value_depth is not None
            if self._value_next and self._depth == self._object_depth():
                self._value_next = False
                if self._key == "arguments":
                    self._current().args_start = i  # the arguments value starts here
                    if ch in "{[":
                        self._value_depth = self._depth + 1
                        in_arguments = True
            if ch == '"':
                self._in_string, self._string_start = True, i
            elif ch in "{[":
                self._depth += 1
                if ch == "{" and not in_arguments and self._depth == self._call_depth and self.plan.mode == "required":
                    self.calls.append(_Call(new_call_id()))
                    self._expect_key = True
            elif ch in "}]":
                if in_arguments and self._depth == self._value_depth:
                    self._current().args_end = i + 1
                    self._value_depth, self._key = None, None
                self._depth -= 1
            elif ch == "," and not in_arguments and self._depth == self._call_depth:
                self._expect_key = True
            elif ch == ":" and not in_arguments and self._depth == self._call_depth:
                self._expect_key, self._value_next = False, True

    def _object_depth(self) -> int:
        """The depth at which a call's arguments value starts."""
        return 0 if self.plan.mode == "named" else self._call_depth

    def _end_string(self, end: int) -> None:
        if self._value_depth is not None or self.plan.mode == "named":
            return
        if self._depth != self._call_depth:
            return
        raw = self.text[self._string_start:end]
        if self._expect_key:
            self._key = json.loads(raw)
        elif self._key == "name":
            self._current().name = json.loads(raw)
            self._key = None

    def _current(self) -> _Call:
        return self.calls[-1]

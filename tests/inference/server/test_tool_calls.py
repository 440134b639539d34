"""The pieces of forced tool calls without a server: what tools / tool_choice ask for, the
grammar the engine compiles for it (llguidance, SmolLM2's tokenizer: which outputs it takes),
reading an output back as tool calls chunk by chunk, and how tools reach the prompt."""

from __future__ import annotations

import json

import pytest

from inference.engine.structured_output import GrammarCache, StructuredOutput
from inference.models.chat_template import ChatTemplate
from inference.models.tokenizer import Tokenizer, load_tokenizer
from inference.server.chat import _prompt
from inference.server.errors import APIError
from inference.server.tool_calls import ToolCallReader, tool_plan
from inference.server.tool_prompt import (
    template_takes_tools,
    with_calls_in_text,
    with_tools_in_text,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "city": {"type": "string"}},
                   "required": ["unit", "city"], "additionalProperties": False}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: {} only


@pytest.fixture(scope="module")
def grammars(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)
    cache = GrammarCache(tokenizer, tokenizer.vocab_size)
    yield tokenizer, cache
    cache.shutdown()


def _accepts(grammars, grammar: str, text: str) -> bool:
    tokenizer, cache = grammars
    matcher = cache.compile(StructuredOutput.lark(grammar)).new_matcher()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


def test_tool_choice_modes():
    assert tool_plan(None, None, None) is None and tool_plan([], "auto", None) is None
    assert tool_plan([WEATHER], "none", True) is None
    named = tool_plan([NOW, WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.mode == "named" and [f.name for f in named.functions] == ["get_weather"]
    assert named.functions[0].index == 1
    required = tool_plan([NOW, WEATHER], "required", None)
    assert required.mode == "required" and not required.parallel  # one call unless asked for an array
    assert tool_plan([NOW, WEATHER], "required", True).parallel


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([WEATHER], None, "tool_choice"), ([WEATHER], "auto", "tool_choice"), (None, "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "now"}}, "tool_choice"),
    ([{"type": "function", "function": {"name": "a.b"}}], "required", "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "required",
     "tools[1].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], "required", "tools[0].function.description"),
])
def test_bad_tool_fields_name_the_parameter(tools, choice, param):
    with pytest.raises(APIError) as e:
        tool_plan(tools, choice, None)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_the_named_grammar_is_the_arguments_in_schema_order(grammars):
    grammar = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None).grammar()
    assert _accepts(grammars, grammar, '{"unit":"c","city":"Paris"}')
    assert not _accepts(grammars, grammar, '{"city":"Paris","unit":"c"}')  # order of the schema
    assert not _accepts(grammars, grammar, '{"unit": "c", "city": "Paris"}')  # compact JSON
    assert not _accepts(grammars, grammar, '{"unit":"k","city":"Paris"}')


def test_the_required_grammar_is_one_call_of_any_tool_name_first(grammars):
    one = tool_plan([WEATHER, NOW], "required", None).grammar()
    assert _accepts(grammars, one, '{"name":"now","arguments":{}}')
    assert _accepts(grammars, one, '{"name":"get_weather","arguments":{"unit":"f","city":"Oslo"}}')
    assert not _accepts(grammars, one, '{"name":"now","arguments":{"unit":"f"}}')
    assert not _accepts(grammars, one, '{"arguments":{},"name":"now"}')
    assert not _accepts(grammars, one, '[{"name":"now","arguments":{}}]')
    many = tool_plan([WEATHER, NOW], "required", True).grammar()
    assert _accepts(grammars, many, '[{"name":"now","arguments":{}},{"name":"now","arguments":{}}]')
    assert not _accepts(grammars, many, "[]")


def _read(plan, text: str, step: int) -> tuple[ToolCallReader, list[dict]]:
    reader = ToolCallReader(plan)
    deltas = []
    for i in range(0, len(text), step):
        deltas += reader.feed(text[i:i + step])
    return reader, deltas


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_an_output_is_read_back_the_same_in_any_chunking(step):
    plan = tool_plan([WEATHER, NOW], "required", True)
    text = '[{"name":"get_weather","arguments":{"unit":"c","city":"Pa\\"}],ris"}},{"name":"now","arguments":{}}]'
    reader, deltas = _read(plan, text, step)
    assert reader.complete
    calls = reader.tool_calls()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"unit": "c", "city": 'Pa"}],ris'}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    # Stream deltas: per call, a header (id, type, name, arguments "") first, then fragments only.
    streamed: dict[int, str] = {}
    for d in deltas:
        if d["index"] not in streamed:
            assert d["id"] == calls[d["index"]]["id"] and d["type"] == "function"
            assert d["function"] == {"name": calls[d["index"]]["function"]["name"], "arguments": ""}
            streamed[d["index"]] = ""
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            streamed[d["index"]] += d["function"]["arguments"]
    assert list(streamed.values()) == [c["function"]["arguments"] for c in calls]


def test_a_cut_off_output_is_not_complete():
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None)
    reader, _ = _read(named, '{"unit":"c","ci', 1)
    assert not reader.complete
    assert reader.tool_calls()[0]["function"] == {"name": "get_weather", "arguments": '{"unit":"c","ci'}
    reader, deltas = _read(tool_plan([WEATHER, NOW], "required", None), '{"name":"get_wea', 1)
    assert reader.tool_calls() == [] and deltas == [] and not reader.complete


def test_tools_are_written_into_the_system_message_for_a_template_without_tools(smollm2_path):
    template = load_tokenizer(smollm2_path).chat_template
    assert not template_takes_tools(template)  # SmolLM2's plain ChatML
    functions = tool_plan([WEATHER], "required", None).functions
    messages = with_tools_in_text([{"role": "user", "content": "Hi"}], functions)
    assert messages[0]["role"] == "system" and '"name": "get_weather"' in messages[0]["content"]
    assert '"unit": {"enum": ["c", "f"]}' in messages[0]["content"]
    kept = with_tools_in_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                              functions)
    assert len(kept) == 2 and kept[0]["content"].startswith("Be brief.\n\n")
    history = with_calls_in_text([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}])
    assert history[0]["content"] == '{"name": "now", "arguments": {}}'
    prompt = template.render([*messages, *history, {"role": "tool", "tool_call_id": "call_1", "content": "noon"}])
    assert "get_weather" in prompt and '{"name": "now"' in prompt and "<|im_start|>tool\nnoon" in prompt


TOOLS_TEMPLATE = ("{% for t in tools or [] %}T:{{ t.function.name }}|{% endfor %}"
                  "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}C:{{ c.function.name }}{% endfor %}|{% endfor %}")


def test_a_template_with_tools_gets_them_as_tools(smollm2_path):
    assert template_takes_tools(ChatTemplate(TOOLS_TEMPLATE))
    smollm2 = load_tokenizer(smollm2_path)
    tokenizer = Tokenizer(smollm2.backend, bos_token=smollm2.bos_token, eos_token=smollm2.eos_token,
                          chat_template=TOOLS_TEMPLATE)
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}}]}]
    # The route's prompt: encoded with the tools by the template, the earlier call left to it too.
    prompt = _prompt(messages, tool_plan([WEATHER], "required", None), tokenizer)
    assert tokenizer.decode(prompt["prompt"]) == "T:get_weather|user:Hi|assistant:C:now|"
    assert _prompt(messages, None, tokenizer) == {"messages": messages}

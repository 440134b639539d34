"""Structured output without a model: the spec and its limits, the grammar cache (compile
errors naming the part, LRU bound, bad grammars remembered), logit_bias validation, and the
sampler applying grammar masks and biases per row (other rows bit-identical). The real SmolLM2
tokenizer gives the grammars real tokens; the engine side is in test_structured_output_engine.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inference.engine.sampler import Sampler, SamplingBatch, apply_logits_processors
from inference.engine.sampling_params import SamplingParams
from inference.engine.structured_output import (
    MAX_GRAMMAR_BYTES,
    GrammarCache,
    StructuredOutput,
    StructuredOutputError,
)
from inference.models.tokenizer import Tokenizer, load_tokenizer

V = 49152 + 64  # logits wider than the tokenizer's 49152 ids


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def grammars(tokenizer: Tokenizer):
    cache = GrammarCache(tokenizer, V, max_entries=4)
    yield cache
    cache.shutdown()


def allowed_ids(cache: GrammarCache, matcher) -> set[int]:
    words = cache.fill_bitmask([matcher])[0].tolist()  # [W] int32
    return {32 * w + j for w, word in enumerate(words) for j in range(32) if (word >> j) & 1}


def build(params, constrained=(), bitmask=None):
    n = len(params)
    return SamplingBatch.build(
        params=params, prompt_ids=[[] for _ in range(n)], output_ids=[[] for _ in range(n)],
        generators=[None] * n, vocab_size=V, device="cpu", constrained_rows=constrained, token_bitmask=bitmask,
    )  # fmt: skip


# -- the spec --------------------------------------------------------------------------------


def test_spec_kinds_keys_and_source() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    spec = StructuredOutput.json_schema(schema)
    assert spec.kind == "json_schema" and json.loads(spec.source) == {**schema, "additionalProperties": False}
    assert list(json.loads(spec.source)["properties"]) == ["b", "a"]  # the schema's order is kept
    assert spec.key == StructuredOutput.json_schema(json.loads(json.dumps(schema))).key
    keys = {spec.key, StructuredOutput.json_object().key, StructuredOutput.lark('start: "x"').key}
    assert len(keys) == 3 and all(len(k) == 64 for k in keys)
    assert StructuredOutput.json_object().source == ""


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StructuredOutput.json_schema({"x": "y" * MAX_GRAMMAR_BYTES}),
         rf"^response_format\.json_schema: is \d+ bytes; the limit is {MAX_GRAMMAR_BYTES} bytes"),
        (lambda: StructuredOutput.lark("a" * (MAX_GRAMMAR_BYTES + 1)), r"^grammar: is 65537 bytes; the limit"),
        (lambda: StructuredOutput.json_schema([1, 2]), r"^response_format\.json_schema: must be a JSON object"),
        (lambda: StructuredOutput.json_schema({"x": float("nan")}), r"^response_format\.json_schema: is not JSON"),
        (lambda: StructuredOutput.lark("  "), r"^grammar: must not be empty"),
        (lambda: StructuredOutput("regex", "a+"), r"^response_format: unknown kind 'regex'"),
    ],
)  # fmt: skip
def test_bad_specs_are_refused_naming_the_part(make, message) -> None:
    with pytest.raises(StructuredOutputError, match=message):
        make()


# -- compiling -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "field", "words"),
    [
        (StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}),
         "response_format.json_schema", "Invalid type: strin"),
        (StructuredOutput.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}),
         "response_format.json_schema", "/$defs/missing"),
        (StructuredOutput.lark("start: nothing_defined"), "grammar", "nothing_defined"),
    ],
)  # fmt: skip
def test_bad_grammars_fail_to_compile_naming_the_part(grammars, spec, field, words) -> None:
    with pytest.raises(StructuredOutputError) as info:
        grammars.compile(spec)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ") and words in str(info.value)
    assert "\n" not in str(info.value)  # one line, no parser state
    assert grammars.get(spec).exception() is info.value  # remembered: refused at once next time


def test_cache_hits_and_stays_bounded(grammars) -> None:
    specs = [StructuredOutput.lark(f'start: "word{i}"') for i in range(6)]
    first = grammars.get(specs[0])
    compiles = grammars.compiles
    assert grammars.get(specs[0]) is first and grammars.compiles == compiles
    for spec in specs[1:]:
        grammars.compile(spec)
    assert len(grammars) == 4  # max_entries
    assert grammars.get(specs[0]) is not first  # the least recently used was dropped


def test_json_object_mask_allows_only_object_starts_and_never_padding_ids(grammars, tokenizer) -> None:
    matcher = grammars.compile(StructuredOutput.json_object()).new_matcher()
    allowed = allowed_ids(grammars, matcher)
    assert allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed)
    assert max(allowed) < 49152
    for token in tokenizer.encode('{"a":[1,2]}'):
        assert matcher.consume_token(token)
    assert matcher.is_stopped()
    assert allowed_ids(grammars, matcher) == tokenizer.stop_token_ids  # only EOS is left


def test_each_request_gets_its_own_matcher(grammars, tokenizer) -> None:
    compiled = grammars.compile(StructuredOutput.lark('start: "ab" | "cd"'))
    first, second = compiled.new_matcher(), compiled.new_matcher()
    assert first.consume_tokens(tokenizer.encode("ab"))
    assert not second.is_stopped() and second.consume_tokens(tokenizer.encode("cd"))


# -- logit_bias parameter ------------------------------------------------------------------


def test_logit_bias_is_normalised() -> None:
    assert SamplingParams(logit_bias={"50": 5, 7: -100}).logit_bias == {50: 5.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({1: 101}, r"^logit_bias\[1\] must be in \[-100, 100\], got 101"),
        ({1: float("inf")}, r"^logit_bias\[1\] must be finite"),
        ({1: "x"}, r"^logit_bias\[1\] must be a number"),
        ({-3: 1}, r"^logit_bias key -3 is not a token id"),
        ({"abc": 1}, r"^logit_bias key 'abc' is not a token id"),
        ({True: 1}, r"^logit_bias key True is not a token id"),
        ([1, 2], r"^logit_bias must be a map of token id to bias"),
    ],
)
def test_bad_logit_bias_is_refused_naming_the_field(bias, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(logit_bias=bias)


def test_structured_output_must_be_a_spec() -> None:
    with pytest.raises(ValueError, match="^structured_output must be a StructuredOutput"):
        SamplingParams(structured_output={"type": "json_object"})


# -- the sampler ------------------------------------------------------------------------------


def test_mask_and_bias_touch_only_their_rows(grammars, tokenizer) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V) * 3
    matcher = grammars.compile(StructuredOutput.lark('start: "yes" | "no"')).new_matcher()
    bits = grammars.fill_bitmask([matcher])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0),  # constrained
        SamplingParams(temperature=0, logit_bias={123: 100.0}),
        SamplingParams(temperature=0.7, logit_bias={5: -100.0}),
    ]
    batch = build(params, constrained=[1], bitmask=bits)
    processed = apply_logits_processors(logits, batch)
    assert torch.equal(processed[0], logits[0])  # bit for bit
    changed = (processed != logits).nonzero().tolist()
    assert [2, 123] in changed and [3, 5] in changed
    assert {r for r, _ in changed} == {1, 2, 3} and sum(r != 1 for r, _ in changed) == 2
    out = Sampler()(logits, batch)
    assert out.token_ids[0] == logits[0].argmax()
    picked = tokenizer.decode([int(out.token_ids[1])])
    assert picked in {"yes", "no", "y", "n", "ye"} and int(out.token_ids[1]) in allowed_ids(grammars, matcher)
    assert out.token_ids[2] == 123  # +100 on a N(0, 3) logit wins


def test_constrained_random_rows_never_sample_a_forbidden_token(grammars) -> None:
    matcher = grammars.compile(StructuredOutput.json_object()).new_matcher()
    allowed = allowed_ids(grammars, matcher)
    bits = grammars.fill_bitmask([matcher.deep_copy() for _ in range(8)])
    logits = torch.zeros(8, V)  # flat: every token equally likely before the mask
    for top_k, top_p in ((0, 1.0), (50, 1.0), (0, 0.9)):
        params = [SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)] * 8
        out = Sampler()(logits, build(params, constrained=list(range(8)), bitmask=bits))
        assert set(out.token_ids.tolist()) <= allowed


def test_logprobs_stay_those_of_the_raw_logits(grammars) -> None:
    logits = torch.randn(1, V)
    matcher = grammars.compile(StructuredOutput.json_object()).new_matcher()
    params = [SamplingParams(temperature=0, logprobs=1, logit_bias={7: 50.0})]
    out = Sampler()(logits, build(params, constrained=[0], bitmask=grammars.fill_bitmask([matcher])))
    token = int(out.token_ids[0])
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[token])


def test_a_narrow_bitmask_forbids_the_ids_past_it() -> None:
    logits = torch.zeros(1, V)
    logits[0, V - 1] = 10.0  # the favourite lies past the mask's 32 ids
    bits = torch.full((1, 1), -1, dtype=torch.int32)  # ids 0..31 allowed
    out = Sampler()(logits, build([SamplingParams(temperature=0)], constrained=[0], bitmask=bits))
    assert int(out.token_ids[0]) < 32


def test_build_checks_the_bitmask_shape() -> None:
    with pytest.raises(ValueError, match="token_bitmask must be"):
        build([SamplingParams()], constrained=[0], bitmask=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="token_bitmask is required"):
        build([SamplingParams()], constrained=[0])
    with pytest.raises(ValueError, match="logit_bias: token id"):
        build([SamplingParams(logit_bias={V: 1.0})])


# -- the server's pre-check -----------------------------------------------------------------


class _EngineWithGrammars:
    """What AsyncEngine's pre-check touches of the engine: its grammar cache (a real one)."""

    def __init__(self, grammars: GrammarCache) -> None:
        self.grammars = grammars
        self.scheduler = self.block_manager = self.stats = None

    def has_unfinished_requests(self) -> bool:
        return False

    def do_idle_work(self) -> None:  # nothing is ever deferred: it runs no requests
        pass


async def test_async_precheck_refuses_bad_schemas_and_warms_the_cache(grammars) -> None:
    import asyncio

    from inference.server.async_engine import AsyncEngine

    server = AsyncEngine(lambda: _EngineWithGrammars(grammars))
    server._take_snapshot = lambda: None  # the stand-in has no scheduler to read
    server.start()
    try:
        await asyncio.wait_for(asyncio.to_thread(server.ready.wait, 30), 35)
        good = StructuredOutput.json_schema({"type": "object", "properties": {"precheck": {"type": "integer"}}})
        await server.check_structured_output(good)
        assert grammars.get(good).done() and grammars.get(good).exception() is None  # cached
        with pytest.raises(StructuredOutputError, match=r"^response_format\.json_schema: .*minItems"):
            await server.check_structured_output(
                StructuredOutput.json_schema({"type": "array", "minItems": 2, "maxItems": 1})
            )
    finally:
        server.shutdown()


def test_objects_with_listed_properties_allow_no_others_unless_the_schema_says_so():
    from inference.engine.structured_output import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a property's name
            "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
            "items": {"type": "array", "items": {"type": "object", "properties": {"z": {}}}},
            "free": {"type": "object"},
        },
        "$defs": {"node": {"anyOf": [{"properties": {"n": {}}}, {"type": "null"}]}},
    }
    closed = closed_objects(schema)

    assert closed["additionalProperties"] is False
    props = closed["properties"]
    assert set(props) == {"properties", "open", "items", "free"}  # no property was added
    assert props["properties"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True
    assert props["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in props["free"]  # no properties listed: any object
    assert closed["$defs"]["node"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    assert '"additionalProperties":false' in StructuredOutput.json_schema(schema).source

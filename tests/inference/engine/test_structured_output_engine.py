"""Structured output through the engine, as a client sees it: constrained outputs validate and
finish "stop", constrained and free requests (base and adapter) share batches without changing
each other's tokens, logit_bias steers greedy picks, a slow or bad grammar never holds up or
breaks the others, preemption keeps constrained outputs valid.

A tiny random fp32 Llama with the real SmolLM2 tokenizer (so JSON grammars have real tokens to
work with) and a vocabulary padded past the tokenizer's (those ids must never be picked); one
test on the real SmolLM2 GGUF.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest

from inference.config import EngineConfig
from inference.engine.llm_engine import LLMEngine
from inference.engine.sampling_params import SamplingParams
from inference.engine.structured_output import StructuredOutput, StructuredOutputError
from inference.llm import LLM
from inference.models.tokenizer import load_tokenizer
from tests.inference.lora.peft_adapters import write_peft_adapter
from tests.inference.models.tiny_llama import write_tiny_checkpoint

BASE_DIR = "SmolLM2-135M-Instruct"  # the adapters' recorded base
TOKENIZER_VOCAB = 49152
MODEL_VOCAB = TOKENIZER_VOCAB + 64  # padded embedding rows the tokenizer has no token for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colors", "address"],
    "additionalProperties": False,
}
# A short answer (~15 tokens), for the tests that run many requests.
SMALL = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
PROMPTS = [[5, 17, 3, 99, 42, 7, 250, 11], [1000, 2000, 3000], [77] * 20, [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    root = tmp_path_factory.mktemp("structured")
    base = root / BASE_DIR
    write_tiny_checkpoint(base, vocab_size=MODEL_VOCAB)
    load_tokenizer(smollm2_path).backend.save(str(base / "tokenizer.json"))
    (base / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))
    write_peft_adapter(root / "a", seed=3, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return root


def make_engine(root: Path, **overrides) -> LLMEngine:
    config = dict(model=str(root / BASE_DIR), dtype="float32", max_loras=1, max_cpu_loras=2,
                  max_lora_rank=8, kv_cache_memory="8MiB", max_num_seqs=16)  # fmt: skip
    return LLMEngine(EngineConfig(**{**config, **overrides}), progress=False)


@pytest.fixture(scope="module")
def engine(root: Path):
    engine = make_engine(root)
    engine.add_adapter("a", root / "a")
    yield engine
    engine.shutdown()


def params(spec: StructuredOutput | None = None, **kwargs) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 0.0, "structured_output": spec, **kwargs})


def run(engine: LLMEngine, requests: list[tuple]) -> list:
    """requests: (prompt, params, lora) each, all in one batch; their final outputs in order."""
    ids = [engine.add_request(prompt, p, lora=lora) for prompt, p, lora in requests]
    done = engine.run_until_done(ids)
    return [done[i] for i in ids]


def test_json_schema_output_validates_and_finishes_with_stop(engine: LLMEngine) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    for prompt in PROMPTS[:2]:
        [out] = run(engine, [(prompt, params(spec, max_tokens=200), None)])
        assert out.finish_reason == "stop", (out.text, out.error)
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        assert list(value) == list(SCHEMA["properties"])  # properties in the schema's order
        assert all(t < TOKENIZER_VOCAB for t in out.token_ids)


def test_json_object_output_is_one_json_object(engine: LLMEngine) -> None:
    # The random model would write a key forever: logit_bias makes it close strings and the object.
    bias = {engine.tokenizer.encode(c)[0]: 30.0 for c in ('"', "}")}
    [out] = run(engine, [(PROMPTS[0], params(StructuredOutput.json_object(), logit_bias=bias), None)])
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_lark_grammar_forces_its_text_then_stops(engine: LLMEngine) -> None:
    spec = StructuredOutput.lark('start: "yes" | "no"')
    [out] = run(engine, [(PROMPTS[2], params(spec), None)])
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_mixed_batch_equals_each_request_alone(engine: LLMEngine) -> None:
    schema = StructuredOutput.json_schema(SMALL)
    lark = StructuredOutput.lark('start: ("ab" | "cd" | " ")+ "."')
    requests = [
        (PROMPTS[0], params(max_tokens=8, ignore_eos=True), None),
        (PROMPTS[1], params(schema), None),
        (PROMPTS[2], params(max_tokens=8, ignore_eos=True), "a"),
        (PROMPTS[3], params(schema), "a"),
        (PROMPTS[0], params(lark, max_tokens=8), "a"),
        (PROMPTS[1], params(max_tokens=8, ignore_eos=True, logit_bias={500: 5.0}), None),
    ]
    alone = [run(engine, [r])[0].token_ids for r in requests]
    together = run(engine, requests)
    assert [o.token_ids for o in together] == alone
    for out, (_, p, _) in zip(together, requests, strict=True):
        if p.structured_output is schema:
            assert out.finish_reason == "stop"
            jsonschema.validate(json.loads(out.text), SMALL)
    assert alone[3] != run(engine, [(PROMPTS[3], requests[3][1], None)])[0].token_ids  # the adapter matters


def test_logit_bias_forces_and_bans_greedy_tokens(engine: LLMEngine) -> None:
    [free] = run(engine, [(PROMPTS[0], params(max_tokens=6, ignore_eos=True), None)])
    [forced] = run(engine, [(PROMPTS[0], params(max_tokens=6, ignore_eos=True, logit_bias={1234: 100}), None)])
    assert forced.token_ids == [1234] * 6
    banned = dict.fromkeys(free.token_ids, -100.0)
    [out] = run(engine, [(PROMPTS[0], params(max_tokens=6, ignore_eos=True, logit_bias=banned), None)])
    assert not set(out.token_ids) & set(banned)
    # The grammar wins over a bias: a banned-by-grammar token never appears however favoured.
    [yes_no] = run(engine, [(PROMPTS[2], params(StructuredOutput.lark('start: "yes" | "no"'), logit_bias={1234: 100}), None)])
    assert yes_no.text in ("yes", "no")


def test_logit_bias_outside_the_vocabulary_is_refused(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="^logit_bias: token id 49216 is not in the vocabulary"):
        engine.add_request(PROMPTS[0], params(logit_bias={MODEL_VOCAB: 1.0}))
    assert not engine.has_unfinished_requests()


def test_a_known_bad_schema_is_refused_at_add_request(engine: LLMEngine) -> None:
    bad = StructuredOutput.json_schema({"type": "array", "minItems": 3, "maxItems": 1})
    with pytest.raises(StructuredOutputError):
        engine.grammars.compile(bad)
    with pytest.raises(StructuredOutputError, match=r"^response_format\.json_schema: .*minItems"):
        engine.add_request(PROMPTS[0], params(bad), lora="a")
    assert not engine.has_unfinished_requests()


class _Gate:
    """Holds the engine's grammar compiles until `open()`: a compile that takes 'forever'."""

    def __init__(self, engine: LLMEngine) -> None:
        self.event = threading.Event()
        self._engine = engine
        self._compile = engine.grammars._compile

        def gated(spec):
            self.event.wait(30)
            return self._compile(spec)

        engine.grammars._compile = gated

    def open(self) -> None:
        self.event.set()
        self._engine.grammars._compile = self._compile


def test_a_compiling_grammar_does_not_block_other_requests(engine: LLMEngine) -> None:
    spec = StructuredOutput.lark('start: "slow" " grammar"')
    gate = _Gate(engine)
    try:
        slow = engine.add_request(PROMPTS[1], params(spec))
        fast = engine.add_request(PROMPTS[0], params(max_tokens=5, ignore_eos=True))
        done = {}
        while fast not in done:
            for out in engine.step():
                assert out.request_id == fast  # the slow one has not run a single step
                if out.finished:
                    done[fast] = out
        assert done[fast].finish_reason == "length" and engine.num_waiting == 1
    finally:
        gate.open()
    assert engine.run_until_done([slow])[slow].text == "slow grammar"


def test_a_grammar_failing_while_the_request_waits_finishes_it_with_an_error(engine: LLMEngine) -> None:
    bad = StructuredOutput.lark("start: undefined_rule")
    gate = _Gate(engine)
    try:
        request_id = engine.add_request(PROMPTS[0], params(bad), lora="a")  # accepted: not compiled yet
    finally:
        gate.open()
    out = engine.run_until_done([request_id])[request_id]
    assert out.finish_reason == "error" and out.token_ids == []
    assert out.error.startswith("grammar: ") and "undefined_rule" in out.error
    assert not engine.has_unfinished_requests()


def test_abort_while_compiling(engine: LLMEngine) -> None:
    gate = _Gate(engine)
    try:
        request_id = engine.add_request(PROMPTS[0], params(StructuredOutput.lark('start: "aborted"')), lora="a")
        assert engine.abort_request(request_id)
    finally:
        gate.open()
    [out] = engine.step()
    assert out.request_id == request_id and out.finish_reason == "abort"
    assert not engine.has_unfinished_requests()


def test_preemption_keeps_constrained_outputs_valid_and_unchanged(root: Path, engine: LLMEngine) -> None:
    spec = StructuredOutput.json_schema(SMALL)
    requests = [(PROMPTS[i % 4] * 3, params(spec), None) for i in range(6)]
    roomy = run(engine, requests)
    # 3 layers x 16 tokens x 2 kv heads x 16 dims x 2 (K, V) x 4 bytes = 12,288 bytes per block
    tight = make_engine(root, kv_cache_memory=9 * 12_288, enable_prefix_caching=False)
    try:
        outs = run(tight, requests)
        assert tight.stats.num_preemptions > 0
    finally:
        tight.shutdown()
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SMALL)


def test_offline_llm_generates_structured_output_and_refuses_bad_schemas(root: Path) -> None:
    llm = LLM(str(root / BASE_DIR), dtype="float32", kv_cache_memory="4MiB")
    try:
        [out] = llm.generate(PROMPTS[3], params(StructuredOutput.json_schema(SCHEMA), max_tokens=200))
        jsonschema.validate(json.loads(out.text), SCHEMA)
        with pytest.raises(StructuredOutputError, match="^response_format.json_schema: Invalid type"):
            llm.generate(PROMPTS[3], params(StructuredOutput.json_schema({"type": "strin"})))
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.shutdown()


def test_real_model_answers_in_the_schema(smollm2_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"enum": ["France", "Spain", "Italy"]}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    llm = LLM(str(smollm2_path), dtype="float32", kv_cache_memory="64MiB")
    try:
        messages = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
        [out] = llm.chat(messages, params(StructuredOutput.json_schema(schema), max_tokens=30))
    finally:
        llm.engine.shutdown()
    assert out.finish_reason == "stop"
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert value == {"city": "Paris", "country": "France"}

"""Structured output: constrain a request's tokens to a JSON schema or a grammar (llguidance).

    spec = StructuredOutput.json_schema({"type": "object", ...})   # or .json_object(), .lark(text)
    params = SamplingParams(structured_output=spec)
    grammars = GrammarCache(tokenizer, vocab_size)                 # one per engine
    compiled = grammars.get(spec).result()                         # Future: compiles off-thread
    matcher = compiled.new_matcher()                               # one per request

The grammar engine is llguidance (as vLLM uses): it compiles a schema or Lark grammar into a
matcher that, at each step, computes the set of allowed next tokens as a bitmask (one bit per
token id, packed in int32 words: [ceil(V / 32)]) and consumes the token that was picked.

Compiling (schema -> grammar -> lexer and parser tables) takes ~1 ms for a small schema and up
to seconds for a huge one, so it runs in a small thread pool, never on the engine's step
thread, and the result is cached by the spec's `key` (a hash of its kind and canonical text):
a request with a schema seen before starts at once. Each request gets its own matcher,
a cheap deep copy of the cached one's initial state.

Errors: a bad schema or grammar raises StructuredOutputError, whose message starts with the
part of the request it came from (`field`, e.g. "response_format.json_schema: Invalid type:
strin"). A spec whose source is larger than MAX_GRAMMAR_BYTES is refused before compiling.

JSON is compact: no whitespace between tokens (`{"a":1,"b":[2]}`). Flexible whitespace lets a
small model emit newlines forever, and the output parses the same either way.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance
import torch

if TYPE_CHECKING:
    from inference.models.tokenizer import Tokenizer

__all__ = [
    "GRAMMAR_CACHE_SIZE",
    "MAX_GRAMMAR_BYTES",
    "CompiledGrammar",
    "GrammarCache",
    "StructuredOutput",
    "StructuredOutputError",
    "fill_token_bitmask",
]

# The largest schema / grammar source accepted (UTF-8 bytes of `source`). Compile time and
# memory grow with the grammar; 64 KiB holds any schema a person writes by hand.
MAX_GRAMMAR_BYTES = 64 * 1024
# Compiled grammars kept (least recently used dropped first). An entry is the matcher's
# tables: a few KiB to a few MiB for big schemas.
GRAMMAR_CACHE_SIZE = 256
# Compile threads: compiling is CPU-bound Rust that releases the GIL; two keep one slow
# schema from delaying every other while leaving the cores to the model.
COMPILE_THREADS = 2

Kind = Literal["json_object", "json_schema", "lark"]
_KINDS = ("json_object", "json_schema", "lark")
# The part of an OpenAI/vLLM request each kind comes from: errors start with it.
ERROR_FIELDS: Mapping[str, str] = {
    "json_object": "response_format",
    "json_schema": "response_format.json_schema",
    "lark": "grammar",
}
# Compact JSON (see the module docstring); everything else as llguidance defaults.
_JSON_OPTIONS = {"whitespace_flexible": False}
# No parser state in error messages: they go back to the client.
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class StructuredOutputError(ValueError):
    """A schema or grammar that cannot be used. `field` names the request part it came from
    (see ERROR_FIELDS); the message starts with it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    kind: "json_object" (any JSON object), "json_schema" (an instance of the schema) or "lark"
        (a Lark grammar, llguidance's dialect; the start rule is `start`).
    source: the schema as compact JSON text (json.dumps(schema, separators=(",", ":"))) for
        json_schema, the grammar text for lark, "" for json_object. Keys keep their order, not
        sorted: the output's properties come in the schema's order (as OpenAI's do), so two
        schemas that differ only in key order are different specs.
    Build one with the classmethods; the constructor checks the kind and MAX_GRAMMAR_BYTES.
    """

    kind: Kind
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise StructuredOutputError("response_format", f"unknown kind {self.kind!r} (one of {', '.join(_KINDS)})")
        field = ERROR_FIELDS[self.kind]
        if not isinstance(self.source, str):
            raise StructuredOutputError(field, f"must be text, got {type(self.source).__name__}")
        size = len(self.source.encode())
        if size > MAX_GRAMMAR_BYTES:
            raise StructuredOutputError(field, f"is {size} bytes; the limit is {MAX_GRAMMAR_BYTES} bytes")
        if self.kind == "json_object" and self.source:
            raise StructuredOutputError(field, "json_object takes no schema")
        if self.kind == "lark" and not self.source.strip():
            raise StructuredOutputError(field, "must not be empty")

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object", "")

    @classmethod
    def json_schema(cls, schema: Mapping | bool) -> StructuredOutput:
        """schema: a JSON schema (a dict, or true/false)."""
        field = ERROR_FIELDS["json_schema"]
        if not isinstance(schema, Mapping | bool):
            raise StructuredOutputError(field, f"must be a JSON object, got {type(schema).__name__}")
        try:
            source = json.dumps(closed_objects(schema), separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise StructuredOutputError(field, f"is not JSON: {exc}") from None
        return cls("json_schema", source)

    @classmethod
    def lark(cls, text: str) -> StructuredOutput:
        return cls("lark", text)

    @property
    def field(self) -> str:
        return ERROR_FIELDS[self.kind]

    @property
    def key(self) -> str:
        """sha256 of kind and source: the compiled-grammar cache key."""
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()

    def to_llguidance(self) -> str:
        """The grammar in llguidance's own format (not yet checked)."""
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        schema = self.source if self.kind == "json_schema" else '{"type":"object"}'
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)


# Where a JSON schema holds subschemas: one schema, a list of them, or a map of name -> schema.
_ONE_SCHEMA = ("additionalProperties", "unevaluatedProperties", "items", "not", "if", "then", "else",
               "contains", "propertyNames", "additionalItems", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: object) -> object:
    """A copy of `schema` in which an object schema that lists `properties` and says nothing of
    other properties (no additionalProperties, unevaluatedProperties or patternProperties)
    allows no others, as vLLM's default grammar backend (xgrammar's strict mode) and OpenAI's
    strict schemas do. JSON Schema's own default admits any extra key, and a small model given
    that freedom invents properties until max_tokens; `"additionalProperties": true` keeps it.
    Only schema positions are walked, so a property named "properties" stays a name."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _ONE_SCHEMA:
        if key in out:
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    if "properties" in out and not any(
        key in out for key in ("additionalProperties", "unevaluatedProperties", "patternProperties")
    ):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class CompiledGrammar:
    key: str
    matcher: llguidance.LLMatcher  # in its initial state; never advanced (copied per request)
    compile_seconds: float

    def new_matcher(self) -> llguidance.LLMatcher:
        """A fresh matcher for one request (a deep copy: microseconds)."""
        return self.matcher.deep_copy()


class GrammarCache:
    """Compiles specs in a thread pool and keeps the last `max_entries` by key (LRU).

    get(spec) returns a Future of the CompiledGrammar (done already on a hit); a spec that
    failed to compile stays cached as a failed Future, so the same bad schema is refused at once.
    Thread-safe: the server's event loop pre-checks specs while the engine thread reads them.

    vocab_size: the model's logits width. It may exceed the tokenizer's vocabulary (padding
    rows of the embedding): those ids are never allowed.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        max_entries: int = GRAMMAR_CACHE_SIZE,
        num_threads: int = COMPILE_THREADS,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()
        self._entries: OrderedDict[str, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._executor: llguidance.LLExecutor | None = None
        self.compiles = 0  # compile jobs started (cache misses)

    def get(self, spec: StructuredOutput) -> Future:
        """A Future of `spec`'s CompiledGrammar; raises StructuredOutputError when it fails."""
        key = spec.key
        with self._lock:
            future = self._entries.get(key)
            if future is not None:
                self._entries.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._entries[key] = future
            self.compiles += 1
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)  # a pending one finishes for its waiters anyway
            return future

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Synchronous get: wait for the compile (raises StructuredOutputError)."""
        return self.get(spec).result()

    def __len__(self) -> int:
        return len(self._entries)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer (built once, ~0.5 s for a 49k vocabulary)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                tok = self._tokenizer
                eos = sorted(tok.stop_token_ids) or None  # ids the grammar allows once complete
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(), n_vocab=max(self.vocab_size, tok.vocab_size), eos_token=eos
                )
            return self._ll_tokenizer

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar:
        start = time.perf_counter()
        try:
            grammar = spec.to_llguidance()
        except ValueError as exc:
            raise StructuredOutputError(spec.field, str(exc)) from None
        # The constructor never raises on a bad grammar: the matcher is in its error state.
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise StructuredOutputError(spec.field, _first_line(matcher.get_error()))
        return CompiledGrammar(spec.key, matcher, time.perf_counter() - start)

    def fill_bitmask(self, matchers: Sequence[llguidance.LLMatcher]) -> torch.Tensor:
        """The allowed next tokens of each matcher: [len(matchers), ceil(V / 32)] int32 (bit j of
        word w = token 32 * w + j; V = max(vocab_size, the tokenizer's)), computed in parallel
        by llguidance's executor. The sampler trims it to the logits' width."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return fill_token_bitmask(self._executor, matchers, self.ll_tokenizer().vocab_size)


def fill_token_bitmask(
    executor: llguidance.LLExecutor, matchers: Sequence[llguidance.LLMatcher], vocab_size: int
) -> torch.Tensor:
    """[M, ceil(vocab_size / 32)] int32 bitmask of the next tokens each matcher allows."""
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)  # contiguous, CPU
    if matchers:
        executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
        )
    return bitmask


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    """A matcher's error (a token it could not take, a parser limit) as one line."""
    return _first_line(matcher.get_error())


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"

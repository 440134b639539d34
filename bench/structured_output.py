"""Structured output: batch throughput with half of the requests JSON-constrained vs none, and
the grammar compile times, in the same run.

    .venv/bin/python bench/structured_output.py [--quick] [--model PATH] [--batch 32]
        [--max-tokens 64] [--repeats 3] [--dtype float32]

1. Throughput: `batch` chat requests decoded together, greedy, `max-tokens` each; once with
   no request constrained, once with every other request constrained by a JSON schema (a
   list of at least 50 objects, so no constrained request finishes before `max-tokens` and
   both runs produce the same number of tokens). The two runs alternate `repeats` times, each
   going first in turn (a busy machine slows both alike); the median output tokens/s of each is
   compared. Then the sampling step alone (masks filled, applied, argmax) with and without
   the constrained half, fastest of 30: the per-step cost, less exposed to machine noise.
2. Compile time: the tokenizer conversion (once per engine), then a small and a large JSON
   schema and a Lark grammar compiled cold (each with a fresh title, so the cache misses),
   median of 5, and a cache hit.

Goal (issue 17): constrained-half throughput >= 0.9x unconstrained at batch 32. Numbers and
ratios are printed, not asserted; the CPU is named.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import make_prompts  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampler import Sampler, SamplingBatch  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.engine.structured_output import GrammarCache, StructuredOutput  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402

GOAL = 0.9
# Many items, so a constrained request is still inside its JSON when max_tokens ends it.
LONG_LIST = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24}, "score": {"type": "integer"}},
        "required": ["name", "score"],
        "additionalProperties": False,
    },
}


def large_schema(fields: int = 60) -> dict:
    """An object of `fields` properties of mixed types, nested objects, enums and patterns."""
    kinds = [
        {"type": "string", "maxLength": 40},
        {"type": "integer", "minimum": 0, "maximum": 10_000},
        {"enum": ["alpha", "beta", "gamma", "delta"]},
        {"type": "array", "items": {"type": "number"}, "maxItems": 8},
        {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                          "ok": {"type": "boolean"}}, "required": ["id"]},
    ]  # fmt: skip
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(fields)}
    return {"type": "object", "properties": props, "required": list(props)[::2], "additionalProperties": False}


def run_batch(engine: LLMEngine, prompts, constrained: bool, max_tokens: int) -> tuple[float, int]:
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    spec = StructuredOutput.json_schema(LONG_LIST)
    json_params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_output=spec)
    ids = [
        engine.add_request(p, json_params if constrained and i % 2 else free) for i, p in enumerate(prompts)
    ]
    start = time.perf_counter()
    done = engine.run_until_done(ids)
    seconds = time.perf_counter() - start
    assert all(o.finish_reason == "length" for o in done.values()), "a request finished early"
    return seconds, sum(o.usage.completion_tokens for o in done.values())


def sampling_seconds(engine: LLMEngine, grammars: GrammarCache, batch: int, constrained: bool) -> float:
    """One step's structured-output work alone (masks filled, batch built, sampled) on random
    logits [batch, V], half the rows mid-way through LONG_LIST when `constrained`: the fastest
    of 30, the least disturbed by other processes."""
    compiled = grammars.compile(StructuredOutput.json_schema(LONG_LIST))
    matchers = [compiled.new_matcher() for _ in range(batch // 2)]
    for m in matchers:
        m.consume_tokens(engine.tokenizer.encode('[{"name":"ab'))
    vocab = engine.model_config.vocab_size
    logits = torch.randn(batch, vocab)
    params = [SamplingParams(temperature=0.0)] * batch
    rows = list(range(0, batch, 2)) if constrained else []
    times = []
    for _ in range(30):
        start = time.perf_counter()
        bits = grammars.fill_bitmask(matchers) if constrained else None
        sampling = SamplingBatch.build(params, [[]] * batch, [[]] * batch, [None] * batch, vocab, "cpu",
                                       constrained_rows=rows, token_bitmask=bits)  # fmt: skip
        Sampler()(logits, sampling)
        times.append(time.perf_counter() - start)
    return min(times)


def compile_seconds(grammars: GrammarCache, make_spec, n: int = 5) -> float:
    times = []
    for i in range(n):
        spec = make_spec(f"bench-{time.time_ns()}-{i}")
        start = time.perf_counter()
        grammars.compile(spec)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="16 tokens, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.max_tokens, args.repeats = 16, 1

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"capability {torch.backends.cpu.get_cpu_capability()}; {args.dtype}")
    engine = LLMEngine(EngineConfig(model=str(args.model), dtype=args.dtype, max_num_seqs=args.batch), progress=False)
    prompts = make_prompts(engine.tokenizer, args.batch, 20, 120)
    print("model loaded; compiling grammars", flush=True)

    # 2. compile times (first: the tokenizer conversion happens once, on the first compile)
    grammars = GrammarCache(engine.tokenizer, engine.model_config.vocab_size)
    start = time.perf_counter()
    grammars.ll_tokenizer()
    tokenizer_seconds = time.perf_counter() - start
    small = compile_seconds(grammars, lambda t: StructuredOutput.json_schema({**LONG_LIST, "title": t}))
    large = compile_seconds(grammars, lambda t: StructuredOutput.json_schema({**large_schema(), "title": t}))
    lark = compile_seconds(grammars, lambda t: StructuredOutput.lark(
        f'start: item (", " item)* // {t}\nitem: /[a-z]+/ "=" /[0-9]+/'))
    start = time.perf_counter()
    grammars.compile(StructuredOutput.json_schema(LONG_LIST))
    grammars.compile(StructuredOutput.json_schema(LONG_LIST))
    hit = time.perf_counter() - start
    sample_free = sampling_seconds(engine, grammars, args.batch, constrained=False)
    sample_half = sampling_seconds(engine, grammars, args.batch, constrained=True)
    grammars.shutdown()

    # 1. throughput, alternating so machine noise hits both
    print("compiled; decoding", flush=True)
    run_batch(engine, prompts[:4], constrained=True, max_tokens=4)  # warm-up (and the engine's compile)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.repeats):
        for constrained in (False, True) if r % 2 == 0 else (True, False):  # each goes first in turn
            seconds, tokens = run_batch(engine, prompts, constrained, args.max_tokens)
            rates[constrained].append(tokens / seconds)
        print(f"  repeat {r + 1}/{args.repeats}: none {rates[False][-1]:.1f} tok/s, "
              f"half constrained {rates[True][-1]:.1f} tok/s", flush=True)
    engine.shutdown()

    free, half = statistics.median(rates[False]), statistics.median(rates[True])
    ratio = half / free
    print(f"\nthroughput at batch {args.batch}, {args.max_tokens} greedy tokens each (median of {args.repeats}):")
    print(f"  no request constrained      {free:8.1f} output tok/s")
    print(f"  half JSON-constrained       {half:8.1f} output tok/s")
    print(f"  ratio                       {ratio:8.2f}x   (goal >= {GOAL}x: {'met' if ratio >= GOAL else 'MISSED'})")
    step = args.batch / free  # seconds per decode step without constraints
    print(f"  sampling alone, fastest of 30: {sample_free * 1000:.2f} ms free, {sample_half * 1000:.2f} ms half "
          f"constrained: +{(sample_half - sample_free) * 1000:.2f} ms per step against a {step * 1000:.0f} ms step "
          f"(~{step / (step + sample_half - sample_free):.2f}x)")
    print("\ngrammar compile (cold, median of 5):")
    print(f"  tokenizer conversion (once) {tokenizer_seconds * 1000:8.1f} ms")
    print(f"  small JSON schema           {small * 1000:8.2f} ms")
    print(f"  60-property JSON schema     {large * 1000:8.2f} ms")
    print(f"  Lark grammar                {lark * 1000:8.2f} ms")
    print(f"  cache hit (x2)              {hit * 1000:8.3f} ms")


if __name__ == "__main__":
    main()

"""Prefix caching: a multi-turn chat workload with the cache on vs off, in the same run.

    .venv/bin/python bench/prefix_cache.py [--quick] [--model PATH] [--conversations 16]
        [--adapters 4] [--turns 8] [--system-tokens 500] [--max-tokens 32] [--dtype bfloat16]

1. Multi-turn chat: `conversations` conversations over `adapters` adapters (random PEFT LoRA,
   rank 16, all seven projections); each adapter is one tenant with its own system prompt of
   `system-tokens` tokens and its own cache_salt. Turn by turn, every conversation sends its
   whole history plus a new question (all conversations of a turn at once) and waits for the
   answer (`max-tokens` greedy tokens). Reported: TTFT p50 / p90 over all requests, requests/s
   and output tokens/s over the workload, and the prefix-cache hit rate in tokens.
   Both engines are loaded side by side and run the workload turn by turn (off, then on), so
   a busy machine slows both alike; the cache-on side replays the off side's answers into its
   histories, so both compute over exactly the same prompts.
2. One request alone whose first 1,000 tokens are cached (a long system prompt), cache on vs
   off: TTFT p50 of 5 requests with different questions.

Goals (issue 21): TTFT p50 with a cached 1,000-token prefix <= 0.2x uncached; multi-turn
throughput >= 2x. Numbers and ratios are printed, not asserted; the CPU is named.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_throughput import WORDS  # noqa: E402
from bench.lora_adapters import base_config, median, write_random_adapters  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402


def text_of_tokens(engine: LLMEngine, n: int, seed: int) -> str:
    """Random words from WORDS, about n tokens long."""
    rng = random.Random(seed)
    words: list[str] = []
    while len(engine.tokenizer.encode(" ".join(words))) < n:
        words += [rng.choice(WORDS) for _ in range(16)]
    return " ".join(words)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def make_engine(args, adapters: list[Path], cache: bool) -> LLMEngine:
    engine = LLMEngine(
        EngineConfig(model=str(args.model), dtype=args.dtype, max_loras=len(adapters), max_cpu_loras=len(adapters),
                     max_lora_rank=16, enable_prefix_caching=cache, kv_cache_memory="1GiB"),
        progress=False,
    )
    for i, path in enumerate(adapters):
        engine.add_adapter(f"tenant{i}", path)
    warm = [engine.add_request("hello", SamplingParams(max_tokens=2), lora=f"tenant{i}", cache_salt="warm")
            for i in range(len(adapters))]
    engine.run_until_done(warm)  # every adapter in its slot: this measures prefill, not loading
    return engine


class Workload:
    """One engine's side of the multi-turn workload: the histories, and what was measured."""

    def __init__(self, engine: LLMEngine, args, systems: list[str]) -> None:
        self.engine, self.args = engine, args
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        self.tenants = [f"tenant{c % len(systems)}" for c in range(args.conversations)]
        self.history = [[{"role": "system", "content": systems[c % len(systems)]}] for c in range(args.conversations)]
        self.ttfts: list[float] = []
        self.seconds = 0.0
        self.prompt_tokens = self.cached_tokens = self.output_tokens = self.requests = 0

    def turn(self, questions: list[str], answers: list[str] | None = None) -> list[str]:
        """Every conversation asks its next question at once; returns the answers. `answers`
        given: they go into the histories instead of this engine's own (the same prompts)."""
        start = time.perf_counter()
        ids = []
        for c, question in enumerate(questions):
            self.history[c].append({"role": "user", "content": question})
            ids.append(self.engine.add_request(messages=self.history[c], params=self.params,
                                               lora=self.tenants[c], cache_salt=self.tenants[c]))
        done = self.engine.run_until_done(ids)
        self.seconds += time.perf_counter() - start
        texts = []
        for c, rid in enumerate(ids):
            out = done[rid]
            self.ttfts.append(out.time_to_first_token)
            self.prompt_tokens += out.usage.prompt_tokens
            self.cached_tokens += out.usage.cached_tokens
            self.output_tokens += out.usage.completion_tokens
            self.requests += 1
            texts.append(out.text)
            self.history[c].append({"role": "assistant", "content": answers[c] if answers else out.text})
        return texts


def prefix_ttft(engine: LLMEngine, prefix: str, question: str) -> float:
    """TTFT of one request alone: a ~1,000-token system prompt and a short question."""
    messages = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
    rid = engine.add_request(messages=messages, params=SamplingParams(max_tokens=1, temperature=0.0))
    return engine.run_until_done([rid])[rid].time_to_first_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--quick", action="store_true", help="8 conversations, 4 turns, 16 tokens")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.max_tokens = 8, 4, 16

    print(f"CPU: {cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"capability {torch.backends.cpu.get_cpu_capability()}; {args.dtype}")
    print(f"workload: {args.conversations} conversations x {args.turns} turns over {args.adapters} adapters, "
          f"{args.system_tokens}-token system prompts, {args.max_tokens} output tokens per turn")
    with tempfile.TemporaryDirectory() as tmp:
        adapters = write_random_adapters(Path(tmp), base_config(args.model), args.adapters, rank=16)
        off = make_engine(args, adapters, cache=False)
        on = make_engine(args, adapters, cache=True)
        systems = [text_of_tokens(off, args.system_tokens, seed=i) for i in range(args.adapters)]
        rng = random.Random(1)
        questions = [[" ".join(rng.choice(WORDS) for _ in range(12)) + "?" for _ in range(args.conversations)]
                     for _ in range(args.turns)]
        # Turn by turn, off then on, so that a busy machine slows both sides alike.
        results = {"off": Workload(off, args, systems), "on": Workload(on, args, systems)}
        for turn in range(args.turns):
            answers = results["off"].turn(questions[turn])
            results["on"].turn(questions[turn], answers)
            print(f"  turn {turn + 1}/{args.turns}: off {results['off'].seconds:.0f} s, "
                  f"on {results['on'].seconds:.0f} s so far", flush=True)

        long_prefix = text_of_tokens(off, 1000, seed=99)
        prefix_ttft(on, long_prefix, "warm-up question")  # the prefix is now cached
        ttft_alone: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(5):
            question = f"question number {i}: what does the text say about {WORDS[i]}?"
            for name, engine in (("off", off), ("on", on)):
                ttft_alone[name].append(prefix_ttft(engine, long_prefix, question))
        off.shutdown()
        on.shutdown()

    print(f"\n{'cache':>5} {'seconds':>8} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
          f"{'prompt tok':>10} {'cached':>7}")
    for name, r in results.items():
        print(f"{name:>5} {r.seconds:8.1f} {r.requests / r.seconds:7.2f} {r.output_tokens / r.seconds:9.1f} "
              f"{median(r.ttfts) * 1000:7.0f}ms {percentile(r.ttfts, 0.9) * 1000:7.0f}ms "
              f"{r.prompt_tokens:10d} {r.cached_tokens / max(1, r.prompt_tokens):6.0%}")
    on, off = results["on"], results["off"]
    alone_on, alone_off = median(ttft_alone["on"]), median(ttft_alone["off"])
    print(f"\nmulti-turn throughput on/off: {off.seconds / on.seconds:.2f}x (goal >= 2x)")
    print(f"multi-turn TTFT p50 on/off:   {median(on.ttfts) / median(off.ttfts):.2f}x")
    print(f"1,000-token cached prefix, one request alone: TTFT p50 {alone_on * 1000:.0f} ms cached vs "
          f"{alone_off * 1000:.0f} ms uncached = {alone_on / alone_off:.2f}x (goal <= 0.2x)")


if __name__ == "__main__":
    main()

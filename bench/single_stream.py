"""Single-stream decode: our engine (each --weights-dtype) vs llama.cpp on the same GGUF file.

    python bench/single_stream.py [--model PATH] [--tokens 128] [--threads 2] [--repeats 3]
                                  [--modes auto,int8,int4] [--quick] [--no-quality]

A mode is a --weights-dtype value, optionally with the quantised weights' kernel forced
(--quant-kernel): `int4:torch`, `int4:fused`; without one the engine's start-up race picks it,
and each mode's line says which ran.

Batch 1, greedy, a short prompt, `--tokens` new tokens past EOS; decode tok/s is (tokens - 1)
over the time from the first token to the last, best of `--repeats` rounds. Each round runs
every contestant once in turn, so a busy machine slows all alike. llama.cpp runs through
llama-cpp-python (`make bench-peers` builds it) with n_threads = torch's threads; absent, its
row says "peer not installed". Goal (issue 16): ours >= 0.5x llama.cpp.

Quality of the quantised modes, against the dense bf16 weights (mode auto):
- greedy agreement: 8 prompts x 64 tokens, the index of the first token that differs (64: none)
  and the share of positions whose token is the same;
- perplexity of bench/data/ppl.txt (English prose written for this repository), from the
  engine's prompt logprobs.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine_line, plan_line  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.llm import LLM  # noqa: E402

GOAL = 0.5
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
QUALITY_PROMPTS = [
    "The capital of France is",
    "Explain photosynthesis to a ten-year-old.",
    "def fibonacci(n):",
    "List three uses of copper.",
    "Once upon a time, in a small village by the sea,",
    "What is the difference between weather and climate?",
    "Translate to French: The cat is sleeping on the sofa.",
    "Write a haiku about autumn leaves.",
]


def decode_rate(stamps: list[float]) -> float:
    """Token arrival times -> decode tok/s (the first token is the prefill's)."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


class Ours:
    def __init__(self, model: str, mode: str, threads: int) -> None:
        self.label = mode  # weights dtype[:quantised kernel]
        self.name = f"ours, weights {mode}"
        weights, _, kernel = mode.partition(":")
        self.llm = LLM(model, weights_dtype=weights, quant_kernel=kernel or "auto", num_threads=threads,
                       max_loras=0, kv_cache_memory="64MiB", enable_prefix_caching=False)  # fmt: skip

    def run(self, tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        stamps = []
        for out in self.llm.stream(PROMPT, params):
            stamps += [time.perf_counter()] * len(out.delta_token_ids)
        return decode_rate(stamps)


class LlamaCpp:
    def __init__(self, model: str, threads: int) -> None:
        from llama_cpp import Llama, llama_cpp

        self.name = "llama.cpp"
        self.version = getattr(llama_cpp, "__version__", "") or "llama-cpp-python"
        self.llm = Llama(model_path=model, n_threads=threads, n_threads_batch=threads, n_ctx=512,
                         verbose=False)  # fmt: skip
        self.prompt = self.llm.tokenize(PROMPT.encode())

    def run(self, tokens: int) -> float:
        self.llm.reset()
        stamps = []
        for _ in self.llm.generate(self.prompt, top_k=1, temp=0.0, reset=True):  # never stops on EOS
            stamps.append(time.perf_counter())
            if len(stamps) == tokens:
                break
        return decode_rate(stamps)


def load_peer(model: str, threads: int) -> LlamaCpp | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    return LlamaCpp(model, threads)


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float, int]:
    """-> (mean first-divergence index, % same tokens position by position, prompts identical)."""
    firsts, same, total = [], 0, 0
    for a, b in zip(ref, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        firsts.append(first)
        same += sum(x == y for x, y in zip(a, b, strict=False))
        total += max(len(a), len(b))
    return sum(firsts) / len(firsts), 100 * same / total, sum(a == b for a, b in zip(ref, got, strict=True))


def perplexity(llm: LLM, text: str) -> float:
    [out] = llm.generate(text, SamplingParams(max_tokens=0, prompt_logprobs=0))
    lps = [lp.logprob for lp in out.prompt_logprobs if lp is not None]
    return math.exp(-sum(lps) / len(lps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="auto,int8,int4", help="--weights-dtype values to measure")
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--no-quality", action="store_true", help="speed only")
    parser.add_argument("--quick", action="store_true", help="64 tokens, 2 rounds, 4 prompts x 32 tokens")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats, args.quality_tokens = 64, 2, 32
    torch.set_num_threads(args.threads)
    modes = args.modes.split(",")

    print(machine_line())
    print(f"model: {args.model}; batch 1, greedy, {args.tokens} new tokens, best of {args.repeats}")
    contestants: list = [Ours(args.model, mode, args.threads) for mode in modes]
    peer = load_peer(args.model, args.threads)
    if peer is not None:
        contestants.append(peer)
    best = {c.name: 0.0 for c in contestants}
    for _ in range(args.repeats):
        for c in contestants:
            best[c.name] = max(best[c.name], c.run(args.tokens))

    peer_rate = best.get("llama.cpp")
    print(f"\n{'contestant':<22} {'decode tok/s':>12} {'/ llama.cpp':>12}   goal >= {GOAL}x")
    for c in contestants:
        ratio = f"{best[c.name] / peer_rate:.2f}x" if peer_rate else "-"
        print(f"{c.name:<22} {best[c.name]:>12.1f} {ratio:>12}")
    if peer is None:
        print(f"{'llama.cpp':<22} {'peer not installed (make bench-peers)':>12}")
    for c in contestants[: len(modes)]:
        pb = c.llm.engine.memory_stats()["base_weights"] / 2**20
        print(f"  {c.name}: weights {pb:.0f} MiB; {plan_line(c.llm.engine)}")

    if args.no_quality:
        return
    prompts = QUALITY_PROMPTS[:4] if args.quick else QUALITY_PROMPTS
    params = SamplingParams(max_tokens=args.quality_tokens, temperature=0, ignore_eos=True)
    text = (ROOT / "bench/data/ppl.txt").read_text()
    ours = {c.label: c.llm for c in contestants[: len(modes)]}
    ref_mode = "auto" if "auto" in ours else modes[0]
    ref = [o.token_ids for o in ours[ref_mode].generate(prompts, params)]
    print(f"\nquality vs weights {ref_mode} ({len(prompts)} prompts x {args.quality_tokens} greedy tokens; "
          f"perplexity of bench/data/ppl.txt)")
    print(f"{'weights':<10} {'first divergence':>16} {'same tokens':>12} {'identical':>10} {'perplexity':>11}")
    for mode, llm in ours.items():
        got = ref if mode == ref_mode else [o.token_ids for o in llm.generate(prompts, params)]
        first, same, identical = agreement(ref, got)
        print(f"{mode:<10} {first:>16.1f} {same:>11.1f}% {identical:>6}/{len(prompts)} {perplexity(llm, text):>11.3f}")


if __name__ == "__main__":
    main()

"""Scale: 1,000 registered adapters, 16 device slots, 128 host entries, Zipf(1.0) traffic.

    .venv/bin/python bench/multi_lora_scale.py [--quick] [--model PATH] [--adapters 1000]

1,000 real, distinct adapters (default rank 8 on all seven projections, bf16, ~4.7 MiB each) are
written to a temporary directory and registered with `add_adapter` (each validated and loaded
through the host tier, which keeps the last 128). Requests pick an adapter by Zipf(1.0) over a
random permutation of the adapters (popularity unrelated to registration order) and run
closed-loop: --concurrency requests in flight, a new one submitted as each finishes (what a
server under steady load sees, so temporal locality is what Zipf gives and no more).

The same prompts then run base-only with the same concurrency. Prints throughput of each and
the ratio, and hit rates per tier from the change in `lora_stats()` over the timed run
(device hits, host hits, misses = loads from disk). --quick: 200 adapters, fewer requests.
No assertions.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lora_adapters import adapter_nbytes, base_config, write_random_adapters, zipf_choices  # noqa: E402
from inference.config import EngineConfig  # noqa: E402
from inference.engine.llm_engine import LLMEngine  # noqa: E402
from inference.engine.sampling_params import SamplingParams  # noqa: E402
from inference.models.fetch import default_model_path  # noqa: E402


def closed_loop(engine: LLMEngine, prompts, routes, max_tokens: int, concurrency: int) -> tuple[float, int, int]:
    """Keep `concurrency` requests in flight -> (seconds, output tokens, errors)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo = deque(zip(prompts, routes, strict=True))
    in_flight, tokens, errors = set(), 0, 0
    start = time.perf_counter()
    while todo or in_flight:
        while todo and len(in_flight) < concurrency:
            prompt, route = todo.popleft()
            in_flight.add(engine.add_request(prompt, params, lora=route))
        for out in engine.step():
            if out.finished and out.request_id in in_flight:
                in_flight.discard(out.request_id)
                tokens += out.usage.completion_tokens
                errors += out.finish_reason == "error"
    return time.perf_counter() - start, tokens, errors


def delta(after: dict, before: dict) -> dict:
    return {
        "device": after["hits"]["device"] - before["hits"]["device"],
        "host": after["hits"]["host"] - before["hits"]["host"],
        "misses": after["misses"] - before["misses"],
        "loads": after["loads"] - before["loads"],
        "evictions_device": after["evictions"]["device"] - before["evictions"]["device"],
        "evictions_host": after["evictions"]["host"] - before["evictions"]["host"],
        "load_seconds": after["load_seconds"][len(before["load_seconds"]):],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--host", type=int, default=128)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true", help="200 adapters, 96 requests, 8 output tokens")
    args = ap.parse_args()
    if args.quick:
        args.adapters, args.requests, args.max_tokens = 200, 96, 8

    cfg = base_config(args.model)
    engine = LLMEngine(
        EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=256, max_loras=args.slots,
                     max_cpu_loras=args.host, max_lora_rank=args.rank),
        progress=False,
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(16, 128))] for _ in range(args.requests)]
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-scale-"))
    try:
        start = time.perf_counter()
        paths = write_random_adapters(tmp, cfg, args.adapters, rank=args.rank)
        print(f"model {engine.model_name}, {args.dtype}; {args.adapters} adapters rank {args.rank}, all seven "
              f"projections ({adapter_nbytes(cfg, args.rank) / 2**20:.1f} MiB each) written in "
              f"{time.perf_counter() - start:.1f}s; {args.slots} slots, {args.host} host entries")

        start = time.perf_counter()
        futures = [engine.add_adapter(p.name, p, wait=False) for p in paths]
        for f in futures:
            f.result()
        seconds = time.perf_counter() - start
        print(f"  registered {len(paths)} adapters in {seconds:.1f}s ({len(paths) / seconds:.0f}/s, validated and loaded)")

        popularity = list(range(args.adapters))
        rng.shuffle(popularity)  # Zipf rank k -> adapter popularity[k]
        ranks = zipf_choices(args.adapters, args.requests, s=args.zipf, seed=1)
        routes = [paths[popularity[k]].name for k in ranks]
        print(f"  {args.requests} requests over {len(set(routes))} distinct adapters (Zipf {args.zipf}), prompts "
              f"16-128 tokens, {args.max_tokens} output tokens, {args.concurrency} in flight")

        closed_loop(engine, prompts[:4], [None] * 4, 2, 4)  # warm-up
        before = engine.lora_stats()
        lora_s, lora_n, lora_err = closed_loop(engine, prompts, routes, args.max_tokens, args.concurrency)
        d = delta(engine.lora_stats(), before)
        base_s, base_n, _ = closed_loop(engine, prompts, [None] * len(prompts), args.max_tokens, args.concurrency)

        print(f"  Zipf adapters: {lora_n} tokens in {lora_s:6.1f}s = {lora_n / lora_s:7.1f} output tok/s "
              f"({lora_err} errors)")
        print(f"  base only    : {base_n} tokens in {base_s:6.1f}s = {base_n / base_s:7.1f} output tok/s")
        lookups = d["device"] + d["host"] + d["misses"]
        if lookups:
            print(f"  hit rates over {lookups} adapter lookups: device {d['device'] / lookups:.1%}, "
                  f"host {d['host'] / lookups:.1%}, miss (disk) {d['misses'] / lookups:.1%}")
        loads = sorted(d["load_seconds"])
        load_note = f", load median {loads[len(loads) // 2] * 1e3:.1f} ms" if loads else ""
        print(f"  loads {d['loads']}{load_note}; evictions device {d['evictions_device']}, host {d['evictions_host']}")
        print("  memory: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in engine.memory_stats().items()))
        print(f"\nratio Zipf-adapter / base-only throughput = {(lora_n / lora_s) / (base_n / base_s):.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
